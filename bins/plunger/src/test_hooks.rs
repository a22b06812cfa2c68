//! Test-only knobs, compiled in only with the `test-hooks` feature (which
//! `cargo test --workspace` turns on through testkit; a release build of a
//! binary alone never has it).

use std::time::Duration;

/// The pre-delete hook's retry window, shortened for tests of failures that
/// persist (the real window is 180 s): `FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS`.
pub fn hook_retry_window_override() -> Option<Duration> {
    seconds_from("FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS")
}

/// The pre-delete hook's pod wait, shortened for tests of a pod stuck
/// `Terminating` that need retries after the wait (the real wait is G + 10 s,
/// at least 50 s): `FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS`.
pub fn hook_pod_wait_override() -> Option<Duration> {
    seconds_from("FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS")
}

fn seconds_from(var: &str) -> Option<Duration> {
    if !cfg!(feature = "test-hooks") {
        return None;
    }
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
}
