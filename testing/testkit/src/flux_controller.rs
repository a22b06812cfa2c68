//! What running one of Flux's controllers (helm-, source-, notification-)
//! against the local control plane takes, whichever it is: the binary `make
//! tools` built from its pinned module, a directory of its own, a kubeconfig
//! with the admin certificate, the flags every Flux controller shares, and a
//! wait for its `/readyz`.
//!
//! Each runs under a [`Supervised`] supervisor: stopped, and its directory
//! removed, when the test process ends however it ends (see [`crate::process`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::control_plane::{AuthInfo, control_plane, free_port, tail, tool, workspace_root};
use crate::process::Supervised;

/// How long a Flux controller may take to serve its readiness probe: two
/// shared cores also run the apiserver, etcd, the other controllers and the
/// tests.
pub const START_TIMEOUT: Duration = Duration::from_secs(90);

/// A Flux controller running against the local control plane.
pub struct FluxController {
    /// What it is and which version, e.g. `source-controller v1.9.3`.
    pub name: String,
    /// Its directory (removed once it stopped).
    pub dir: PathBuf,
    /// Its log (console encoding).
    pub log: PathBuf,
    /// Its readiness endpoint, `http://127.0.0.1:PORT/readyz`.
    pub readyz: String,
    server: Mutex<Supervised>,
}

/// A fresh directory for a controller, in the temporary directory, named
/// `prefix…` (`hack/check-no-leftovers.sh` looks for those prefixes).
pub fn scratch_dir(prefix: &str) -> Result<PathBuf> {
    Ok(tempfile::Builder::new().prefix(prefix).tempdir()?.keep())
}

/// The version of `pin` (e.g. `SOURCE_CONTROLLER_VERSION`) in
/// `hack/tools/versions.mk`, unless `$env` names another one.
pub fn pinned_version(env: &str, pin: &str) -> Result<String> {
    if let Some(version) = std::env::var_os(env) {
        return Ok(version.to_string_lossy().into_owned());
    }
    let pins = workspace_root().join("hack/tools/versions.mk");
    let text = std::fs::read_to_string(&pins)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", pins.display()))?;
    let prefix = format!("{pin} :=");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map(|v| v.trim().to_owned())
        .ok_or_else(|| anyhow::anyhow!("no {pin} in {}", pins.display()))
}

impl FluxController {
    /// Starts `_out/bin/<binary>-<version>` in `dir` with `args` besides the
    /// shared ones, and `env` besides `KUBECONFIG`, and waits until it is
    /// ready. Blocking: call it from a thread of its own, not a runtime.
    pub fn start(
        binary: &str,
        version: &str,
        dir: &Path,
        args: Vec<String>,
        env: &[(&str, &Path)],
    ) -> Result<Self> {
        let started = Instant::now();
        let name = format!("{binary} {version}");
        let program = tool(&format!("{binary}-{version}"))?;
        let kubeconfig = dir.join("kubeconfig");
        control_plane().write_kubeconfig(&kubeconfig, &AuthInfo::AdminCertificate)?;
        let log = dir.join(format!("{binary}.log"));
        let health_port = free_port()?;
        let mut all_args = vec![
            // An ephemeral port: nothing here scrapes it.
            "--metrics-addr=127.0.0.1:0".to_owned(),
            format!("--health-addr=127.0.0.1:{health_port}"),
            // One instance per control plane: nothing to elect.
            "--enable-leader-election=false".to_owned(),
            "--log-encoding=console".to_owned(),
            "--log-level=info".to_owned(),
        ];
        all_args.extend(args);
        let mut all_env = vec![("KUBECONFIG", kubeconfig.as_path())];
        all_env.extend(env.iter().copied());
        let mut server =
            Supervised::spawn_with_env(&name, &program, &all_args, &all_env, &log, Some(dir))?;
        let deadline = started + START_TIMEOUT;
        loop {
            if !server.is_running() {
                bail!("{name} exited during start; its log:\n{}", tail(&log, 40));
            }
            if http_get_status(health_port, "/readyz") == Some(200) {
                break;
            }
            if Instant::now() > deadline {
                bail!("{name} was not ready in time; its log:\n{}", tail(&log, 40));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!(
            "testkit: {name} ready in {:.1}s (log {})",
            started.elapsed().as_secs_f64(),
            log.display()
        );
        Ok(Self {
            name,
            dir: dir.to_owned(),
            log,
            readyz: format!("http://127.0.0.1:{health_port}/readyz"),
            server: Mutex::new(server),
        })
    }

    /// The last `lines` lines of its log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }

    /// The lines of its log that mention `needle`.
    pub fn log_lines_with(&self, needle: &str) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }

    /// True while it runs.
    pub fn is_running(&self) -> bool {
        self.server.lock().unwrap().is_running()
    }
}

/// The status code of `GET path` on `127.0.0.1:port`, or `None` if nothing
/// answered.
pub(crate) fn http_get_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.split_whitespace().nth(1)?.parse().ok()
}
