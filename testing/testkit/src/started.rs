//! How the test process starts the services it shares (the control plane,
//! the registry, Flux's controllers): once, on first use, and again only
//! after a start that may have failed for a moment.

use std::sync::OnceLock;

use anyhow::{Result, bail};

/// The service in `cell`, started by `start` on first use. The start runs
/// on a thread of its own, so this may be called from inside a tokio
/// runtime. A failed start is kept too: every later test of the binary
/// fails at once with its message instead of waiting for a start of its
/// own. `what` names the service in that message.
pub fn once<T: Send + Sync + 'static>(
    cell: &'static OnceLock<Result<T, String>>,
    what: &str,
    start: fn() -> Result<T>,
) -> &'static T {
    let started = cell.get_or_init(|| {
        std::thread::spawn(start)
            .join()
            .map_err(|_| format!("{what}: its start thread panicked"))?
            .map_err(|e| format!("{e:#}"))
    });
    match started {
        Ok(service) => service,
        Err(e) => panic!("{what} did not start: {e}"),
    }
}

/// `start_once`, tried up to `attempts` times: a Flux controller is given
/// ports found free a moment before, and should another socket take one
/// first, it exits; a start with new ports follows.
pub fn with_retries<T>(what: &str, attempts: usize, start_once: fn() -> Result<T>) -> Result<T> {
    let mut failures = Vec::new();
    for attempt in 1..=attempts {
        match start_once() {
            Ok(service) => return Ok(service),
            Err(e) => {
                eprintln!("testkit: {what} start {attempt} failed: {e:#}");
                failures.push(format!("{e:#}"));
            }
        }
    }
    bail!(
        "{what} did not start in {attempts} attempts:\n{}",
        failures.join("\n")
    )
}
