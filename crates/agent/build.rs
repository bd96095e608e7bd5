//! Builds nrun's NCCL profiler plugin (nccl/profiler.c) into a shared library that the agent
//! carries inside its binary and installs beside each job's workers (src/gpu_time.rs). It is C
//! because NCCL's plugin interface is a C ABI of function pointers and unions; the compiler is
//! the one cargo links with (the `cc` crate's choice, so a cross or zig build uses its own).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=nccl/profiler.c");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("libnccl-profiler-nrun.so");
    let cc = cc::Build::new().get_compiler();
    let mut cmd: Command = cc.to_command();
    cmd.args([
        "-shared",
        "-fPIC",
        "-O2",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-o",
    ])
    .arg(&out)
    .arg("nccl/profiler.c");
    match cmd.status() {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("building nccl/profiler.c failed ({s}): {cmd:?}"),
        Err(e) => panic!("cannot run the C compiler for nccl/profiler.c ({e}): {cmd:?}"),
    }
}
