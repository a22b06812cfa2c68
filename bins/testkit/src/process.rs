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
}

const SUPERVISOR: &str = r#"
log="$1"; cleanup="$2"; shift 2
# Ctrl-C reaches the whole process group: outlive it to clean up.
trap '' INT
# A background job's stdin is /dev/null in a non-interactive shell: keep the
# pipe from the test process on fd 3 for the watcher.
exec 3<&0
"$@" >"$log" 2>&1 3<&- &
pid=$!
# Wait for the test process to go (our stdin closes), or the server to die.
# Test data is thrown away: a short grace, then KILL (kube-apiserver's graceful
# shutdown can wait long for an etcd that is already gone).
( read -r _ignored <&3; kill -TERM "$pid" 2>/dev/null; sleep 2; kill -KILL "$pid" 2>/dev/null ) &
watcher=$!
wait "$pid"; status=$?
kill "$watcher" 2>/dev/null
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
        Ok(Self {
            child,
            stdin,
            name: name.to_owned(),
        })
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
