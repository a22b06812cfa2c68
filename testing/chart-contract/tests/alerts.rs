//! The chart's alerts and dashboard (`metrics.prometheusRule`, `metrics.dashboard`):
//!
//! - the PrometheusRule's groups pass `promtool check rules` and the unit tests
//!   of `chart-tests/prometheus/` under `promtool test rules` (Prometheus's own
//!   evaluator, built by `make tools` from the pinned module);
//! - every series those tests feed in is one the controller really exported:
//!   its name and labels are on a page of `chart-tests/prometheus/pages/`
//!   (captured from the controller by `bins/flux-plunger/tests/metrics_pages.rs`),
//!   besides the labels a scrape adds;
//! - every metric name the rules' expressions and the dashboard's queries read
//!   is one the controller exports (its whole registry, `Metrics::encode`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use chart_contract::{Render, chart_dir};
use flux_plunger::metrics::Metrics;
use serde_json::Value;

/// The labels a Prometheus Operator scrape gives a series besides its own.
const TARGET_LABELS: &[&str] = &[
    "job",
    "namespace",
    "pod",
    "instance",
    "service",
    "endpoint",
    "container",
];

fn prometheus_dir() -> PathBuf {
    testkit::control_plane::workspace_root()
        .join("chart-tests")
        .join("prometheus")
}

/// The rendered PrometheusRule's `spec` (its groups), as promtool reads a rules file.
fn rule_spec() -> Result<Value> {
    let manifests = Render::new("flux-plunger", "flux-system")
        .set("metrics.prometheusRule.enabled=true")
        .manifests()?;
    Ok(manifests.one("PrometheusRule", false)?["spec"].clone())
}

fn expressions(spec: &Value) -> Vec<String> {
    spec["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["expr"].as_str().map(str::to_owned))
        .collect()
}

fn promtool(dir: &Path, args: &[&str]) -> Result<String> {
    let output = Command::new(testkit::control_plane::tool("promtool")?)
        .args(args)
        .current_dir(dir)
        .output()
        .context("running promtool (make tools builds it)")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if !output.status.success() {
        bail!("promtool {args:?} failed ({}):\n{text}", output.status);
    }
    Ok(text)
}

fn test_files() -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(prometheus_dir())?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.to_string_lossy().ends_with("_test.yaml"));
    files.sort();
    anyhow::ensure!(
        !files.is_empty(),
        "no *_test.yaml in {}",
        prometheus_dir().display()
    );
    Ok(files)
}

#[test]
fn the_rules_pass_promtool_check_and_their_unit_tests() -> Result<()> {
    let spec = rule_spec()?;
    let dir = tempfile::tempdir()?;
    // The whole rule, annotations and their templates included.
    std::fs::write(dir.path().join("rules.yaml"), serde_yaml::to_string(&spec)?)?;
    let checked = promtool(dir.path(), &["check", "rules", "rules.yaml"])?;
    assert!(checked.contains("SUCCESS: 7 rules found"), "{checked}");
    // The unit tests compare an alert's labels; its annotations (prose, and
    // a runbook path) are the chart's unit tests' to check.
    let mut bare = spec.clone();
    for group in bare["groups"].as_array_mut().into_iter().flatten() {
        for rule in group["rules"].as_array_mut().into_iter().flatten() {
            rule.as_object_mut().map(|r| r.remove("annotations"));
        }
    }
    std::fs::write(dir.path().join("rules.yaml"), serde_yaml::to_string(&bare)?)?;
    for file in test_files()? {
        let name = file.file_name().context("a file name")?.to_owned();
        std::fs::copy(&file, dir.path().join(&name))?;
        let out = promtool(dir.path(), &["test", "rules", &name.to_string_lossy()])?;
        eprintln!("{out}");
    }
    Ok(())
}

/// A series as `name{labels}`: its name and labels.
fn parse_series(text: &str) -> Result<(String, BTreeMap<String, String>)> {
    let (name, rest) = text.split_once('{').unwrap_or((text, "}"));
    let body = rest.strip_suffix('}').context("no closing brace")?;
    let mut labels = BTreeMap::new();
    for pair in body.split(',').filter(|p| !p.trim().is_empty()) {
        let (key, value) = pair.split_once('=').context("a label without =")?;
        labels.insert(
            key.trim().to_owned(),
            value.trim().trim_matches('"').to_owned(),
        );
    }
    Ok((name.trim().to_owned(), labels))
}

/// Every series on a text exposition page.
fn page_series(page: &str) -> Result<BTreeSet<(String, BTreeMap<String, String>)>> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| parse_series(l.rsplit_once(' ').map_or(l, |(s, _)| s)))
        .collect()
}

#[test]
fn the_unit_tests_feed_in_only_series_the_controller_exported() -> Result<()> {
    let mut exported = BTreeSet::new();
    for entry in std::fs::read_dir(prometheus_dir().join("pages"))? {
        exported.extend(page_series(&std::fs::read_to_string(entry?.path())?)?);
    }
    anyhow::ensure!(
        exported.len() > 20,
        "too few series on the pages: {exported:?}"
    );
    // A label value the captured run did not produce (a lost race's
    // `conflict`, `released_without_uninstall`) is taken from the exporter's
    // own page, where the label set must be one the captured pages show.
    let values: BTreeSet<(String, String, String)> = page_series(&exporter_page())?
        .into_iter()
        .chain(exported.iter().cloned())
        .flat_map(|(name, labels)| labels.into_iter().map(move |(k, v)| (name.clone(), k, v)))
        .collect();
    let mut shapes: BTreeSet<(String, Vec<String>)> = exported
        .iter()
        .map(|(name, labels)| (name.clone(), labels.keys().cloned().collect()))
        .collect();
    // A family the captured run never wrote (no hand-over happened in it):
    // its label names as the exporter writes them.
    let captured: BTreeSet<String> = exported.iter().map(|(name, _)| name.clone()).collect();
    for (name, labels) in page_series(&exporter_page())? {
        if !captured.contains(&name) {
            shapes.insert((name, labels.into_keys().collect()));
        }
    }
    let mut checked = 0;
    for file in test_files()? {
        let tests: Value = serde_yaml::from_str(&std::fs::read_to_string(&file)?)?;
        for test in tests["tests"].as_array().into_iter().flatten() {
            for input in test["input_series"].as_array().into_iter().flatten() {
                let text = input["series"].as_str().context("series")?;
                let (name, mut labels) = parse_series(text)?;
                for target in TARGET_LABELS {
                    labels.remove(*target);
                }
                let shape = (name.clone(), labels.keys().cloned().collect::<Vec<_>>());
                assert!(
                    shapes.contains(&shape),
                    "{}: {text}: no series of that name and those labels on a page of \
                     chart-tests/prometheus/pages/ (as {name}{labels:?})",
                    file.display()
                );
                for (key, value) in &labels {
                    assert!(
                        values.contains(&(name.clone(), key.clone(), value.clone())),
                        "{}: {text}: {key}=\"{value}\" is exported by nothing",
                        file.display()
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 10, "only {checked} series checked");
    Ok(())
}

/// The controller's page with every labelled family on it: a family of
/// counters by label is written only once it has a series, so every outcome
/// `Metrics::observe` counts is observed once, and an error of each kind the
/// pages and the rules name (`conflict`: `controller::error_policy`'s lost
/// races, which the reconcile-errors alert leaves out).
fn exporter_page() -> String {
    use plunger::decide::SkipReason;
    use plunger::reconcile::Outcome;
    let metrics = Metrics::default();
    for outcome in [
        Outcome::Recovered { revision: 2 },
        Outcome::Deferred,
        Outcome::Skipped(SkipReason::NoRevisions),
        Outcome::DryRun {
            would: String::new(),
        },
        Outcome::RateLimited {
            retry_after: std::time::Duration::ZERO,
        },
        Outcome::HandedOver { revision: 2 },
        Outcome::ReconcileRequested,
        Outcome::ReleasedWithoutUninstall,
    ] {
        metrics.observe(&outcome);
    }
    for kind in ["conflict", "read_kubeconfig"] {
        metrics.observe_error(kind);
    }
    metrics.encode()
}

/// The metric names the controller exports, as Prometheus stores them: a
/// counter's with `_total`, a histogram's `_bucket`, `_sum` and `_count`.
fn exported_names() -> BTreeSet<String> {
    let page = exporter_page();
    let mut names = BTreeSet::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let Some((name, kind)) = rest.split_once(' ') else {
            continue;
        };
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_owned());
            }
        }
    }
    names
}

/// The metric names a PromQL expression reads: its identifiers outside
/// strings, label matchers (`{...}`), ranges (`[...]`) and grouping lists
/// (`by (...)`, `on (...)`, ...), that are neither a function (followed by
/// `(`) nor a keyword.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // The words a label list in parentheses follows.
    const GROUPING: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    // The other words that are no metric's name.
    const KEYWORDS: &[&str] = &[
        "offset",
        "bool",
        "and",
        "or",
        "unless",
        "inf",
        "nan",
        // The aggregations, written `sum by (...) (...)`.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut last_word = String::new();
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += usize::from(chars[i] == '\\') + 1;
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    i += 1;
                }
                i += 1;
            }
            '(' if GROUPING.contains(&last_word.as_str()) => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                last_word.clear();
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' || c == '$' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':' | '$'))
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut next = i;
                while next < chars.len() && chars[next].is_whitespace() {
                    next += 1;
                }
                let function = chars.get(next) == Some(&'(');
                if !function
                    && !word.starts_with('$')
                    && ![GROUPING, KEYWORDS]
                        .concat()
                        .contains(&word.to_ascii_lowercase().as_str())
                {
                    names.insert(word.clone());
                }
                last_word = word;
            }
            c if c.is_ascii_digit() || c == '.' => {
                // A number or a duration (`5m`, `1e3`).
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            _ => {
                if !c.is_whitespace() {
                    last_word.clear();
                }
                i += 1;
            }
        }
    }
    names
}

#[test]
fn the_parser_finds_the_names_and_nothing_else() {
    let names = metric_names(
        r#"sum by (namespace, job) (increase(a_total{kind!="x"}[5m]) and b offset 5m) or absent(c{job="j"}) >= 3 or histogram_quantile(0.99, sum by (le) (rate(d_bucket{job=~"$job"}[$__rate_interval])))"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["a_total", "b", "c", "d_bucket"]
    );
}

#[test]
fn the_rules_and_the_dashboard_read_only_metrics_the_controller_exports() -> Result<()> {
    let exported = exported_names();
    for name in [
        "flux_plunger_leader",
        "flux_plunger_fences_inherited_total",
        "process_start_time_seconds",
        "flux_plunger_reconcile_duration_seconds_bucket",
    ] {
        assert!(exported.contains(name), "{name} in {exported:?}");
    }
    let mut used: BTreeMap<String, String> = BTreeMap::new();
    for expr in expressions(&rule_spec()?) {
        for name in metric_names(&expr) {
            used.insert(name, "the PrometheusRule".into());
        }
    }
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(
        chart_dir().join("dashboards").join("flux-plunger.json"),
    )?)?;
    let mut queries = Vec::new();
    collect_queries(&dashboard, &mut queries);
    assert!(
        queries.len() > 15,
        "only {} queries in the dashboard",
        queries.len()
    );
    for query in &queries {
        for name in metric_names(query) {
            used.insert(name, "the dashboard".into());
        }
    }
    let unknown: Vec<_> = used
        .iter()
        .filter(|(name, _)| !exported.contains(*name))
        .collect();
    assert!(
        unknown.is_empty(),
        "metrics the controller does not export: {unknown:?}; it exports {exported:?}"
    );
    // Every family of the controller's own is read somewhere.
    let unread: Vec<_> = exported
        .iter()
        .filter(|n| n.starts_with("flux_plunger_") && !used.contains_key(*n))
        .filter(|n| !n.ends_with("_sum") && !n.ends_with("_count"))
        .collect();
    assert!(
        unread.is_empty(),
        "exported but on no panel or alert: {unread:?}"
    );
    Ok(())
}

/// Every `expr` of the dashboard's panels and every `query` of its variables
/// (`label_values(metric, label)` reads `metric`).
fn collect_queries(node: &Value, out: &mut Vec<String>) {
    match node {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    ("definition", Value::String(query)) => {
                        if let Some(inner) = query
                            .strip_prefix("label_values(")
                            .and_then(|q| q.rsplit_once(','))
                        {
                            out.push(inner.0.to_owned());
                        }
                    }
                    _ => collect_queries(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_queries(v, out)),
        _ => {}
    }
}
