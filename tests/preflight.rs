//! The preflight's control flow, report and exit codes on machines without GPUs: the TCP ring
//! (`--preflight net`) on several real ranks, and the NCCL loader against a real libnccl.so.2
//! (PyPI's nvidia-nccl wheel in the test venv: ncclGetVersion and ncclGetUniqueId need no GPU).

mod common;

use std::path::PathBuf;

use common::setup::net_preflight_args;
use common::*;

#[test]
fn net_preflight_on_three_ranks_reports_and_passes() {
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let mut args = net_preflight_args();
    args.extend(["--report", report.to_str().unwrap()]);
    let out = s.run(&args, &[]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("network (TCP ring) all-reduce, 3 ranks on 1 node(s)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("size (B)") && stdout.contains("busbw GB/s") && stdout.contains("#wrong"),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .last()
            .unwrap()
            .starts_with("preflight ok: busbw "),
        "{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(v["verdict"], "ok");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["world_size"], 3);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 9, "8 B, 32 B, ... 512 KiB: 8 B .. 1 MiB by 4");
    for r in rows {
        assert_eq!(r["out_of_place"]["wrong"], 0);
        assert!(r["out_of_place"]["busbw_gbs"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(v["ranks"].as_array().unwrap().len(), 3);
    s.assert_no_survivors();
}

#[test]
fn too_slow_is_94_and_the_job_does_not_start() {
    let s = Scene::new();
    let marker = s.dir.path().join("job-ran");
    let job = format!("touch {}", marker.display());
    let out = s.run(
        &[
            "--preflight",
            "net",
            "--min-busbw",
            "1000000",
            "--nproc",
            "2",
            "--preflight-sizes",
            "8:64K:4",
            "--no-python",
            "sh",
            "-c",
            &job,
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(94),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("is under --min-busbw 1000000 GB/s"),
        "{stdout}"
    );
    assert!(!marker.exists(), "the job started after a failed preflight");

    // With ,warn the job starts anyway and its own exit code counts.
    let out = s.run(
        &[
            "--preflight",
            "net,warn",
            "--min-busbw",
            "1000000",
            "--nproc",
            "2",
            "--preflight-sizes",
            "8:64K:4",
            "--no-python",
            "sh",
            "-c",
            &job,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(marker.exists());
    assert!(text(&out.stderr).contains("starting the job anyway"));
    s.assert_no_survivors();
}

#[test]
fn a_passing_preflight_is_followed_by_the_job() {
    let s = Scene::new();
    let out = s.run(
        &[
            "--preflight",
            "net",
            "--nproc",
            "2",
            "--preflight-sizes",
            "8:4K:4",
            "--no-python",
            "sh",
            "-c",
            "echo job rank $RANK",
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let verdict = stdout.find("preflight ok").expect(&stdout);
    let job = stdout.find("job rank").expect(&stdout);
    assert!(verdict < job, "the job ran before the verdict: {stdout}");
}

#[test]
fn preflight_flags_are_checked() {
    let s = Scene::new();
    for (args, expect) in [
        (
            vec!["--preflight-only", "--nproc", "2"],
            "no GPU is visible here",
        ),
        (
            vec!["--preflight", "bogus", "--no-python", "true"],
            "--preflight \"bogus\"",
        ),
        (
            vec![
                "--preflight-only",
                "--preflight",
                "net",
                "--preflight-sizes",
                "8:4",
            ],
            "expected MIN:MAX:FACTOR",
        ),
        (
            vec![
                "--preflight-only",
                "--preflight",
                "net",
                "--nccl-lib",
                "/nonexistent/libnccl.so.2",
            ],
            "--nccl-lib /nonexistent/libnccl.so.2: no such file",
        ),
        (
            vec!["--preflight-only", "--no-preflight"],
            "exclude each other",
        ),
    ] {
        let out = s.run(&args, &[("CUDA_VISIBLE_DEVICES", "-1")]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// libnccl.so.2 from the test venv's nvidia-nccl wheel, with the version its metadata names;
/// None, after `cannot_set_up`, where the venv has none.
fn pip_nccl() -> Option<(PathBuf, String)> {
    let py = need_torch()?;
    let out = std::process::Command::new(&py)
        .args(["-c", "import importlib.metadata as m, nvidia.nccl, os; d=[x for x in m.distributions() if x.metadata['Name'].startswith('nvidia-nccl')][0]; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2')); print(d.version)"])
        .output()
        .ok();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let mut lines = text.as_deref().unwrap_or_default().lines();
    let found = lines.next().zip(lines.next());
    if found.is_none() {
        cannot_set_up(&format!(
            "no nvidia-nccl wheel in {} (torch's wheel from PyPI brings it: scripts/venv.sh)",
            py.display()
        ));
    }
    found.map(|(lib, version)| (PathBuf::from(lib), version.to_string()))
}

#[test]
fn nccl_loader_reads_the_real_librarys_version_and_unique_id() {
    let Some((lib, version)) = pip_nccl() else {
        return;
    };
    let nccl = nrun_preflight::nccl::Nccl::open(&lib).unwrap();
    // The wheel's version is like 2.30.7 (sometimes with a suffix); the library's code agrees.
    assert!(
        version.starts_with(&nccl.version.to_string()),
        "library says {}, wheel says {version}",
        nccl.version
    );
    let id = nccl.unique_id().expect("ncclGetUniqueId without a GPU");
    assert!(
        id.internal.iter().any(|b| *b != 0),
        "unique id is all zeroes"
    );
    // The same through nrun's isolated version probe.
    let out = std::process::Command::new(nrun_bin())
        .arg("__nccl-version")
        .arg(&lib)
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout).trim(), nccl.version.to_string());
}

#[test]
fn nccl_preflight_without_a_gpu_names_the_missing_driver() {
    let Some((lib, _)) = pip_nccl() else {
        return;
    };
    if std::path::Path::new("/proc/driver/nvidia/gpus").exists() {
        cannot_set_up("this machine has GPUs: the scenario is a machine without a driver");
        return;
    }
    let s = Scene::new();
    let py = torch_python().unwrap();
    let out = s.run(
        &[
            "--preflight-only",
            "--preflight",
            "nccl",
            "--nproc",
            "2",
            "--python",
            py.to_str().unwrap(),
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(90),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    // The library the job's torch would load was found and named, with its version.
    assert!(stdout.contains(&lib.display().to_string()), "{stdout}");
    assert!(stdout.contains("libcuda.so.1 not found"), "{stdout}");
    assert!(stdout.contains("preflight could not run"), "{stdout}");
    s.assert_no_survivors();
}

/// Real GPUs: run on a machine with them (`cargo test --test preflight -- --ignored`;
/// scripts/gpu-check.sh covers more). Ignored elsewhere: a pass without a GPU would be a pass
/// that ran nothing.
#[test]
#[ignore = "needs a GPU: cargo test --test preflight -- --ignored gpu_preflight"]
fn gpu_preflight() {
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    if gpus == 0 {
        cannot_set_up("no GPU on this machine (/proc/driver/nvidia/gpus)");
        return;
    }
    let s = Scene::new();
    let out = s.run(
        &["--preflight-only", "--nproc", &gpus.to_string()],
        &[("NCCL_NVLS_ENABLE", "0")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
}
