//! The supervisor every server runs under (`testkit::process`): whatever
//! ends the process that started the servers, nothing of them is left. Here
//! the whole process group gets SIGTERM, as from `timeout` or a cancelled CI
//! job — the supervisor's own shell included.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Processes whose command line mentions `dir`, as `pid command`.
fn processes_mentioning(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline
                .contains(&needle)
                .then(|| format!("{pid} {cmdline}"))
        })
        .collect()
}

#[test]
fn a_sigterm_to_the_whole_process_group_leaves_no_server_and_no_directory() -> Result<()> {
    let mut plane = Command::new(env!("CARGO_BIN_EXE_local-control-plane"))
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting local-control-plane")?;
    // Kept open until the end: a closed pipe would end the process by itself
    // (its next print fails), not by the signal under test.
    let mut stdout = BufReader::new(plane.stdout.take().context("no stdout")?);
    let mut dir: Option<PathBuf> = None;
    let mut line = String::new();
    while dir.is_none() && stdout.read_line(&mut line)? > 0 {
        if let Some(path) = line.trim().strip_prefix("kubeconfig:") {
            dir = Path::new(path.trim()).parent().map(Path::to_path_buf);
        }
        line.clear();
    }
    let dir = dir.context("local-control-plane never printed its kubeconfig")?;
    assert!(
        !processes_mentioning(&dir).is_empty(),
        "etcd and kube-apiserver run from {}",
        dir.display()
    );

    let group = format!("-{}", plane.id());
    let status = Command::new("kill")
        .args(["-TERM", "--", &group])
        .status()?;
    assert!(status.success(), "kill -TERM {group}");
    plane.wait()?;
    drop(stdout);

    // The supervisor's grace before SIGKILL is 2 s; kube-apiserver may wait
    // longer than that for an etcd that is already gone.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = processes_mentioning(&dir);
        if left.is_empty() && !dir.exists() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "left behind after SIGTERM to the group: {left:?}; directory {} exists: {}",
                dir.display(),
                dir.exists()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
