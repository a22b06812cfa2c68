//! The process metrics every Prometheus-instrumented controller exports
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! `process_open_fds`, `process_start_time_seconds`, …), read from `/proc`
//! at each scrape, with the names and meanings of Prometheus's own client
//! libraries, so that the dashboards and alerts written for them work here.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The kernel's clock ticks per second in `/proc/<pid>/stat` (`USER_HZ`),
/// which Linux fixes at 100 for user space whatever the kernel's own tick.
const TICKS_PER_SECOND: f64 = 100.0;

/// What `/proc` says of this process.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessFacts {
    pub cpu_seconds: f64,
    pub resident_bytes: i64,
    pub virtual_bytes: i64,
    pub open_fds: i64,
    pub max_fds: Option<i64>,
    pub start_time_seconds: f64,
}

/// From `/proc/self/stat` (`stat`), `/proc/self/status` (`status`),
/// `/proc/self/limits` (`limits`), the boot time of `/proc/stat`
/// (`stat_of_system`) and the count of `/proc/self/fd`; `None` where one
/// does not parse.
pub fn facts_of(
    stat: &str,
    status: &str,
    limits: &str,
    stat_of_system: &str,
    open_fds: i64,
) -> Option<ProcessFacts> {
    // The command name is in parentheses and may hold spaces: the fields
    // are counted after its closing parenthesis (field 3 is the state).
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<f64>().ok());
    let (utime, stime, starttime, vsize) = (field(14)?, field(15)?, field(22)?, field(23)?);
    let boot_time: f64 = stat_of_system
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let resident_kib: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let max_fds = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|soft| soft.parse().ok());
    Some(ProcessFacts {
        cpu_seconds: (utime + stime) / TICKS_PER_SECOND,
        resident_bytes: resident_kib * 1024,
        virtual_bytes: vsize as i64,
        open_fds,
        max_fds,
        start_time_seconds: boot_time + starttime / TICKS_PER_SECOND,
    })
}

/// This process's facts, read now.
fn read() -> Option<ProcessFacts> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as i64;
    facts_of(
        &read("/proc/self/stat")?,
        &read("/proc/self/status")?,
        &read("/proc/self/limits").unwrap_or_default(),
        &read("/proc/stat")?,
        open_fds,
    )
}

/// Encodes the process metrics at each scrape; nothing where `/proc` cannot
/// be read (not Linux).
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(facts) = read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(facts.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            cpu.metric_type(),
        )?)?;
        let mut gauge = |name: &str, help: &str, value: f64| {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)
        };
        gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            facts.resident_bytes as f64,
        )?;
        gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            facts.virtual_bytes as f64,
        )?;
        gauge(
            "process_open_fds",
            "Number of open file descriptors.",
            facts.open_fds as f64,
        )?;
        if let Some(max) = facts.max_fds {
            gauge(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                max as f64,
            )?;
        }
        gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            facts.start_time_seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (flux plunger) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 50 0 0 20 0 9 0 180000 104857600 3000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
    const STATUS: &str = "Name:\tflux-plunger\nVmHWM:\t   14000 kB\nVmRSS:\t   12288 kB\n";
    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
    const SYSTEM: &str = "cpu  1 2 3\nbtime 1764633600\nprocesses 10\n";

    #[test]
    fn the_facts_are_read_as_prometheus_s_clients_read_them() {
        let facts = facts_of(STAT, STATUS, LIMITS, SYSTEM, 11).unwrap();
        assert_eq!(facts.cpu_seconds, 3.0, "(250 + 50) ticks of 1/100 s");
        assert_eq!(facts.resident_bytes, 12288 * 1024);
        assert_eq!(facts.virtual_bytes, 104_857_600);
        assert_eq!(facts.open_fds, 11);
        assert_eq!(facts.max_fds, Some(1_048_576));
        assert_eq!(facts.start_time_seconds, 1_764_633_600.0 + 1800.0);
    }

    #[test]
    fn a_command_name_with_parentheses_and_spaces_does_not_shift_the_fields() {
        let stat = STAT.replace("(flux plunger)", "(a) (b c)");
        assert_eq!(
            facts_of(&stat, STATUS, LIMITS, SYSTEM, 1)
                .unwrap()
                .cpu_seconds,
            3.0
        );
    }

    #[test]
    fn what_does_not_parse_gives_no_facts() {
        assert_eq!(facts_of("garbage", STATUS, LIMITS, SYSTEM, 1), None);
        assert_eq!(facts_of(STAT, "", LIMITS, SYSTEM, 1), None);
        assert_eq!(facts_of(STAT, STATUS, "", SYSTEM, 1).unwrap().max_fds, None);
    }

    #[test]
    fn this_process_s_facts_are_read() {
        let facts = read().expect("/proc is readable on Linux");
        assert!(facts.resident_bytes > 0 && facts.open_fds > 0, "{facts:?}");
    }
}
