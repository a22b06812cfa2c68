//! How much a piece of work raises this process's peak resident memory
//! (`VmHWM`, reset through `/proc/self/clear_refs`). The peak is the whole
//! process's: tests that measure it take turns ([`turn`]) and live in a
//! test binary of their own.

use anyhow::{Context as _, Result};

/// One measurement at a time.
pub async fn turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// `field` of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    Ok(kib * 1024)
}

/// What `work` returns, and how much it raised this process's peak resident
/// memory above what the process held as `work` started.
pub async fn growth<T>(work: impl Future<Output = T>) -> Result<(T, u64)> {
    // Linux resets the peak (VmHWM) to the present size on "5".
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak memory")?;
    let before = status_bytes("VmRSS")?;
    let done = work.await;
    let grown = status_bytes("VmHWM")?.saturating_sub(before);
    eprintln!("the peak memory grew by {} KiB", grown / 1024);
    Ok((done, grown))
}
