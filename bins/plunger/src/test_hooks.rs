//! Test-only knobs, compiled in only with the `test-hooks` feature (which
//! `cargo test --workspace` turns on through testkit; a release build of a
//! binary alone never has it).

use std::time::Duration;

/// The pre-delete hook's retry window, shortened for tests of failures that
/// persist (the real window is 180 s): `FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS`.
pub fn hook_retry_window_override() -> Option<Duration> {
    if !cfg!(feature = "test-hooks") {
        return None;
    }
    std::env::var("FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
}
