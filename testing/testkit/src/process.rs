//! Child processes that cannot outlive the test process.
//!
//! Every server is started under a tiny `sh` supervisor whose standard input
//! is a pipe from the test process. When the test process ends — normally, by
//! a panic, or killed — the kernel closes that pipe, `read` returns, and the
//! supervisor stops the server and removes its directory. No unsafe code
//! (`prctl`) and no reliance on destructors of statics, which Rust never runs.

use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use anyhow::{Context, Result};

/// A server running under a supervisor; dropping it stops the server.
pub struct Supervised {
    child: Child,
    // Held open for the life of the server: closing it is the stop signal.
    stdin: Option<ChildStdin>,
    pub name: String,
    /// Where the supervisor wrote the server's pid.
    pid_file: PathBuf,
}

const SUPERVISOR: &str = r#"
log="$1"; cleanup="$2"; shift 2
# Ctrl-C, and a SIGTERM sent to the whole process group (a `timeout`, a
# cancelled CI job), reach the supervisor too: outlive them to clean up. The
# server gets SIGTERM's default back.
trap '' INT TERM
# A background job's stdin is /dev/null in a non-interactive shell: keep the
# pipe from the test process on fd 3 for the watcher.
exec 3<&0
( trap - TERM; exec "$@" ) >"$log" 2>&1 3<&- &
pid=$!
# The server's own pid, for a test that pauses or kills it (Supervised::signal).
echo "$pid" >"$log.pid"
# Wait for the test process to go (our stdin closes), or the server to die.
# Test data is thrown away: a short grace, then KILL (kube-apiserver's graceful
# shutdown can wait long for an etcd that is already gone).
( read -r _ignored <&3; kill -TERM "$pid" 2>/dev/null; sleep 2; kill -KILL "$pid" 2>/dev/null ) &
watcher=$!
wait "$pid"; status=$?
# KILL: the watcher ignores TERM as this shell does (it inherited the ignored
# disposition), and a watcher left behind would signal, once the test process
# ends, whatever process has reused the server's pid by then.
kill -KILL "$watcher" 2>/dev/null
[ -n "$cleanup" ] && rm -rf "$cleanup"
exit "$status"
"#;

impl Supervised {
    /// Starts `program args…`, logging to `log`; `cleanup` (if any) is removed
    /// once the server has stopped.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        cleanup: Option<&Path>,
    ) -> Result<Self> {
        Self::spawn_with_env(name, program, args, &[], log, cleanup)
    }

    /// As [`Supervised::spawn`], with `env` added to the server's environment
    /// (e.g. `KUBECONFIG` for a server that has no `--kubeconfig` flag).
    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &Path)],
        log: &Path,
        cleanup: Option<&Path>,
    ) -> Result<Self> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(SUPERVISOR)
            .arg("supervisor")
            .arg(log)
            .arg(cleanup.map(PathBuf::from).unwrap_or_default())
            .arg(program)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        let stdin = child.stdin.take();
        let mut pid_file = log.as_os_str().to_owned();
        pid_file.push(".pid");
        Ok(Self {
            child,
            stdin,
            name: name.to_owned(),
            pid_file: PathBuf::from(pid_file),
        })
    }

    /// Sends `signal` (`STOP`, `CONT`, `KILL`, ...) to the server itself, not
    /// its supervisor.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let pid = loop {
            match std::fs::read_to_string(&self.pid_file) {
                Ok(text) if text.ends_with('\n') => break text.trim().to_owned(),
                _ if std::time::Instant::now() > deadline => {
                    anyhow::bail!("{} wrote no pid to {}", self.name, self.pid_file.display())
                }
                _ => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        };
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(&pid)
            .status()
            .with_context(|| format!("kill -{signal} {pid}"))?;
        anyhow::ensure!(
            status.success(),
            "kill -{signal} {pid} ({}) failed",
            self.name
        );
        Ok(())
    }

    /// True while the server runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Stops the server and waits for its supervisor.
    pub fn stop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One of our binaries run by a test: its stderr is echoed (tagged) and kept,
/// so the test can wait for a log line; killed when dropped.
pub struct LoggedProcess {
    pub child: tokio::process::Child,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    /// Set once stderr reached its end: every line is in `log`.
    read_all: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl LoggedProcess {
    /// Spawns `command` (its stderr is taken over) and tags echoed lines.
    pub fn spawn(mut command: tokio::process::Command, tag: &str) -> Result<Self> {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {tag}"))?;
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut lines = BufReader::new(child.stderr.take().context("no stderr")?).lines();
        let sink = log.clone();
        let read_all = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = read_all.clone();
        let tag = tag.to_owned();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{tag}: {line}");
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        Ok(Self {
            child,
            log,
            read_all,
        })
    }

    /// Waits (at most `timeout`) for the exit and for the last line it logged.
    pub async fn wait(&mut self, timeout: std::time::Duration) -> Result<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        let status = tokio::time::timeout(timeout, self.child.wait()).await??;
        while !self.read_all.load(std::sync::atomic::Ordering::SeqCst)
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Ok(status)
    }

    /// Everything logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn logged(&self, text: &str) -> bool {
        self.log.lock().unwrap().contains(text)
    }

    /// Waits until `text` was logged.
    pub async fn wait_logged(&self, text: &str, timeout: std::time::Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        while !self.logged(text) {
            if std::time::Instant::now() > deadline {
                anyhow::bail!("timed out waiting for {text:?} in:\n{}", self.log());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) -> Result<()> {
        let pid = self.child.id().context("the process has exited")?;
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()?;
        Ok(())
    }

    /// Sends SIGTERM and waits (at most `timeout`) for the exit and for the
    /// last line it logged (a test reads the log right after).
    pub async fn terminate(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<std::process::ExitStatus> {
        self.sigterm()?;
        self.wait(timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pids of every process whose command line names `path` (a
    /// supervisor is `sh -c SCRIPT supervisor LOG …`, and its watcher a fork
    /// of it).
    fn processes_naming(path: &Path) -> Vec<String> {
        let needle = path.as_os_str().as_encoded_bytes();
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|entry| {
                std::fs::read(entry.path().join("cmdline"))
                    .is_ok_and(|cmdline| cmdline.windows(needle.len()).any(|w| w == needle))
            })
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// A server that dies before the test process ends takes its supervisor
    /// and the supervisor's watcher with it: a watcher left behind would
    /// signal, when the test process ends, whatever process has reused the
    /// server's pid by then.
    #[test]
    fn a_server_that_dies_leaves_no_watcher_behind() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("server.log");
        let mut server = Supervised::spawn(
            "sleep",
            Path::new("/bin/sleep"),
            &["600".to_owned()],
            &log,
            None,
        )?;
        server.signal("KILL")?;
        server.child.wait()?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let left = processes_naming(&log);
            if left.is_empty() {
                return Ok(());
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "processes of the supervisor left after it ended: {left:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
