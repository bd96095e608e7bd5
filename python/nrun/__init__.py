"""nrun's wheel: the `nrun` binary is installed as a script; `find_nrun_bin` locates it."""

from __future__ import annotations

import os
import sys
import sysconfig


def find_nrun_bin() -> str:
    """The path of the `nrun` binary this wheel installed.

    The scripts directory of the scheme the wheel was installed with: the environment's own,
    then the user's (`pip install --user`), then beside the package (`pip install --target`).
    """
    exe = "nrun" + (sysconfig.get_config_var("EXE") or "")
    candidates = [sysconfig.get_path("scripts")]
    if sys.version_info >= (3, 10):
        user_scheme = sysconfig.get_preferred_scheme("user")
    else:
        user_scheme = "posix_user"
    candidates.append(sysconfig.get_path("scripts", scheme=user_scheme))
    # --target DIR puts the package in DIR and the script in DIR/bin.
    candidates.append(os.path.join(os.path.dirname(os.path.dirname(__file__)), "bin"))
    for scripts in candidates:
        path = os.path.join(scripts, exe)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        "nrun: the nrun binary this package installs is in none of "
        + ", ".join(candidates)
        + " (reinstall the wheel: pip install --force-reinstall nrun)"
    )
