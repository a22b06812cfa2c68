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

/// Test builds only: recovery hooks from the environment, so that a test (or
/// the demo) can hold a real `flux-plunger` process at a step of its recovery:
///
/// - `FLUX_PLUNGER_TEST_PAUSE_AT=acquired` (or `annotated`, `before-acquire`,
///   `before-forced-acquire`, `before-lift`) with
///   `FLUX_PLUNGER_TEST_PAUSE_FILE=PATH`: at that step the process creates
///   `PATH.reached`, then waits (at most 120 s) until `PATH.release` exists;
///   once per process;
/// - `FLUX_PLUNGER_TEST_UNFENCED=1`: suspend without the fence, to show the
///   orphaning the fence prevents.
#[cfg(feature = "test-hooks")]
pub fn hooks_from_env() -> crate::reconcile::TestHooks {
    use crate::reconcile::Step;
    use futures::FutureExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let unfenced = std::env::var("FLUX_PLUNGER_TEST_UNFENCED").is_ok_and(|v| v == "1");
    let step = std::env::var("FLUX_PLUNGER_TEST_PAUSE_AT")
        .ok()
        .and_then(|s| match s.as_str() {
            "before-acquire" => Some(Step::BeforeAcquire),
            "before-forced-acquire" => Some(Step::BeforeForcedAcquire),
            "acquired" => Some(Step::Acquired),
            "annotated" => Some(Step::Annotated),
            "before-lift" => Some(Step::BeforeLift),
            _ => None,
        });
    let file = std::env::var("FLUX_PLUNGER_TEST_PAUSE_FILE").ok();
    let pause = match (step, file) {
        (Some(at), Some(file)) => {
            let done = Arc::new(AtomicBool::new(false));
            let pause: Arc<dyn Fn(Step) -> futures::future::BoxFuture<'static, ()> + Send + Sync> =
                Arc::new(move |step| {
                    if step != at || done.swap(true, Ordering::SeqCst) {
                        return async {}.boxed();
                    }
                    let file = file.clone();
                    async move {
                        let _ = std::fs::write(format!("{file}.reached"), b"");
                        tracing::warn!(?step, "test build: paused until {file}.release exists");
                        let deadline = std::time::Instant::now() + Duration::from_secs(120);
                        while !std::path::Path::new(&format!("{file}.release")).exists()
                            && std::time::Instant::now() < deadline
                        {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    .boxed()
                });
            Some(pause)
        }
        _ => None,
    };
    crate::reconcile::TestHooks { unfenced, pause }
}
