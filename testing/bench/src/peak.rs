//! The peak resident memory of a process that exits on its own (the drain
//! after SIGTERM, the pre-delete hook): its `VmHWM`, read from
//! `/proc/PID/status` every millisecond on a thread of its own until the
//! process has exited. `VmHWM` only grows, so the last reading is the peak
//! of everything up to it; what is missed is a growth in the last
//! millisecond, after the process's last request (the Lease's handover or
//! removal), which no step of either makes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const EVERY: Duration = Duration::from_millis(1);

/// What the readings came to.
#[derive(Debug, Clone, Copy)]
pub struct Peak {
    /// The last `VmHWM` read, in KiB.
    pub kib: u64,
    /// The first `VmHWM` read (as the watch started), in KiB.
    pub first_kib: u64,
    /// How many readings there were.
    pub samples: u64,
    /// When the last one was taken.
    pub last: Instant,
}

/// Reads a process's `VmHWM` until it has exited (a zombie has none) or
/// [`PeakWatch::finish`] is called.
pub struct PeakWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Option<Peak>>,
}

impl PeakWatch {
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak: Option<Peak> = None;
            while !stopped.load(Ordering::Relaxed) {
                let Some(kib) = vm_hwm_kib(pid) else { break };
                let now = Instant::now();
                peak = Some(match peak {
                    None => Peak {
                        kib,
                        first_kib: kib,
                        samples: 1,
                        last: now,
                    },
                    Some(p) => Peak {
                        kib: p.kib.max(kib),
                        samples: p.samples + 1,
                        last: now,
                        ..p
                    },
                });
                std::thread::sleep(EVERY);
            }
            peak
        });
        Self { stop, thread }
    }

    /// Stops reading (the process has exited, so it has stopped already)
    /// and returns what was read; `None` if nothing was.
    pub fn finish(self) -> Option<Peak> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().ok().flatten()
    }
}

/// `VmHWM` of `pid` in KiB; `None` once it has exited.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Whether `pid` has a handler for SIGTERM installed (`SigCgt`).
pub fn catches_sigterm(pid: u32) -> bool {
    const SIGTERM: u32 = 15;
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
            u64::from_str_radix(mask.trim(), 16).ok()
        })
        .is_some_and(|mask| mask & (1 << (SIGTERM - 1)) != 0)
}
