//! `--log-encoding=json` in the shape Flux's controllers write (the zap JSON
//! of fluxcd/pkg/runtime/logger): one object a line with `level` in lower
//! case, `ts`, `logger`, `msg`, then the event's fields. `flux logs` and the
//! log queries written for Flux's controllers read these keys, so
//! flux-plunger's lines sit beside helm-controller's in the same views.
//!
//! A HelmRelease is named as Flux's controllers name the object they
//! reconcile: the call sites log `release = "namespace/name"`, and this
//! formatter alone turns it into `controllerGroup`, `controllerKind`
//! (what `flux logs --kind HelmRelease` matches), `HelmRelease: {name,
//! namespace}`, `namespace` and `name` (what `--name` and `-n` match).

use std::fmt;

use crate::names::{HELMRELEASE_GROUP, HELMRELEASE_KIND};
use serde_json::{Value, json};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The event formatter of `--log-encoding=json`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FluxJson;

impl<S, N> FormatEvent<S, N> for FluxJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    // Spans are not read: no span in flux-plunger carries fields.
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let metadata = event.metadata();
        // A record of the `log` crate arrives with the target "log"; the
        // crate that wrote it is in its `log.target` field.
        let logger = fields
            .log_target
            .take()
            .unwrap_or_else(|| metadata.target().to_owned());

        let mut line = JsonLine::default();
        line.entry("level", &Value::from(flux_level(metadata.level())));
        line.entry("ts", &Value::from(utc_now()?));
        line.entry("logger", &Value::from(logger));
        line.entry("msg", &Value::from(fields.message.unwrap_or_default()));
        for (key, value) in &fields.others {
            line.entry(key, value);
        }
        writeln!(writer, "{}", line.finish())
    }
}

/// The level as zap's lower-case encoder spells it.
fn flux_level(level: &Level) -> &'static str {
    match *level {
        Level::TRACE => "trace",
        Level::DEBUG => "debug",
        Level::INFO => "info",
        Level::WARN => "warn",
        Level::ERROR => "error",
    }
}

/// Now, in RFC 3339 UTC with microseconds (`2026-12-03T08:00:00.123456Z`).
fn utc_now() -> Result<String, fmt::Error> {
    let mut now = String::new();
    SystemTime.format_time(&mut Writer::new(&mut now))?;
    Ok(now)
}

/// A JSON object written key by key, so that the keys keep the order they
/// are given in (a `serde_json::Map` would sort them).
#[derive(Default)]
struct JsonLine {
    text: String,
}

impl JsonLine {
    fn entry(&mut self, key: &str, value: &Value) {
        self.text.push(if self.text.is_empty() { '{' } else { ',' });
        // A `str` and a `Value` always serialize; both escape quotes and
        // newlines, so a line stays one line of valid JSON.
        self.text.push_str(&Value::from(key).to_string());
        self.text.push(':');
        self.text.push_str(&value.to_string());
    }

    fn finish(mut self) -> String {
        if self.text.is_empty() {
            self.text.push('{');
        }
        self.text.push('}');
        self.text
    }
}

/// An event's fields, in the order they were written.
#[derive(Default)]
struct Fields {
    message: Option<String>,
    log_target: Option<String>,
    others: Vec<(&'static str, Value)>,
}

impl Fields {
    fn push(&mut self, field: &Field, value: Value) {
        match (field.name(), value) {
            ("message", value) => self.message = Some(as_text(value)),
            ("log.target", value) => self.log_target = Some(as_text(value)),
            // Where in the `log` crate's caller the record was written:
            // zap writes no caller either.
            ("log.module_path" | "log.file" | "log.line", _) => {}
            ("release", Value::String(key)) => self.push_release(key),
            (name, value) => self.others.push((name, value)),
        }
    }

    /// `release = "namespace/name"` as Flux's controllers name the object
    /// they reconcile; any other value stays as it is.
    fn push_release(&mut self, key: String) {
        match key.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
                self.others
                    .push(("controllerGroup", Value::from(HELMRELEASE_GROUP)));
                self.others
                    .push(("controllerKind", Value::from(HELMRELEASE_KIND)));
                self.others
                    .push(("HelmRelease", json!({"name": name, "namespace": namespace})));
                self.others.push(("namespace", Value::from(namespace)));
                self.others.push(("name", Value::from(name)));
            }
            _ => self.others.push(("release", Value::String(key))),
        }
    }
}

fn as_text(value: Value) -> String {
    match value {
        Value::String(text) => text,
        other => other.to_string(),
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.push(field, Value::from(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.push(field, Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.push(field, Value::from(value));
    }

    // NaN and the infinities have no JSON number: they become null.
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.push(field, Value::from(value));
    }

    // `%value` (Display), `?value` (Debug), errors and the message itself
    // all arrive here, as text.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field, Value::from(format!("{value:?}")));
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use serde_json::{Map, Value, json};

    use super::FluxJson;

    /// A writer into a shared buffer, for a test subscriber's output.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// What `log` writes through [`FluxJson`], every level enabled.
    fn written(log: impl FnOnce()) -> String {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .event_format(FluxJson)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let bytes = buffer.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    /// The one line `log` writes, parsed.
    fn one_line(log: impl FnOnce()) -> Map<String, Value> {
        let text = written(log);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        match serde_json::from_str(lines[0]) {
            Ok(Value::Object(object)) => object,
            other => panic!("not a JSON object: {other:?} from {text}"),
        }
    }

    #[test]
    fn a_line_has_flux_keys_and_the_fields() {
        let line = one_line(|| {
            tracing::info!(target: "plunger::reconcile", revision = 3, secret = %"sh.helm.release.v1.web.v3", dry = false, "deleted the newest storage revision");
        });
        assert_eq!(line["level"], "info");
        assert_eq!(line["logger"], "plunger::reconcile");
        assert_eq!(line["msg"], "deleted the newest storage revision");
        assert_eq!(line["revision"], 3);
        assert_eq!(line["secret"], "sh.helm.release.v1.web.v3");
        assert_eq!(line["dry"], false);
        let mut keys: Vec<&str> = line.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["dry", "level", "logger", "msg", "revision", "secret", "ts"]
        );
    }

    #[test]
    fn keys_keep_the_order_they_are_written_in() {
        let text = written(|| tracing::info!(b = 1, a = 2, "m"));
        let position = |key: &str| text.find(&format!("\"{key}\":")).unwrap();
        let order = ["level", "ts", "logger", "msg", "b", "a"];
        assert!(
            order.windows(2).all(|w| position(w[0]) < position(w[1])),
            "{text}"
        );
    }

    #[test]
    fn ts_is_rfc_3339_utc_with_fractional_seconds() {
        let line = one_line(|| tracing::info!("m"));
        let ts = line["ts"].as_str().unwrap();
        // 2026-12-03T08:00:00.123456Z
        let (date, time) = ts.split_once('T').unwrap();
        assert_eq!(date.len(), 10, "{ts}");
        assert_eq!(date.matches('-').count(), 2, "{ts}");
        let (seconds, fraction) = time.strip_suffix('Z').unwrap().split_once('.').unwrap();
        assert_eq!(seconds.len(), 8, "{ts}");
        assert!(
            !fraction.is_empty() && fraction.bytes().all(|b| b.is_ascii_digit()),
            "{ts}"
        );
    }

    #[test]
    fn levels_are_spelled_as_zap_spells_them() {
        let text = written(|| {
            tracing::trace!("m");
            tracing::debug!("m");
            tracing::info!("m");
            tracing::warn!("m");
            tracing::error!("m");
        });
        let levels: Vec<Value> = text
            .lines()
            .map(|line| serde_json::from_str::<Value>(line).unwrap()["level"].clone())
            .collect();
        assert_eq!(levels, ["trace", "debug", "info", "warn", "error"]);
    }

    #[test]
    fn a_release_is_named_as_flux_names_the_object_it_reconciles() {
        let key = "apps/web".to_owned();
        let line = one_line(|| tracing::info!(release = %key, "fence released"));
        assert_eq!(
            line["HelmRelease"],
            json!({"name": "web", "namespace": "apps"})
        );
        assert_eq!(line["namespace"], "apps");
        assert_eq!(line["name"], "web");
        // What `flux logs --kind HelmRelease` matches, as controller-runtime
        // writes it for helm-controller.
        assert_eq!(line["controllerKind"], "HelmRelease");
        assert_eq!(line["controllerGroup"], "helm.toolkit.fluxcd.io");
        assert!(!line.contains_key("release"), "{line:?}");
    }

    #[test]
    fn a_release_without_a_namespace_stays_as_it_is() {
        for key in ["web", "/web", "apps/"] {
            let line = one_line(|| tracing::info!(release = key, "m"));
            assert_eq!(line["release"], key);
            for absent in ["HelmRelease", "namespace", "name"] {
                assert!(!line.contains_key(absent), "{line:?}");
            }
        }
    }

    #[test]
    fn an_error_stays_error() {
        let err = io::Error::other("connection refused");
        let line = one_line(|| tracing::warn!(error = %err, "could not release; retrying"));
        assert_eq!(line["level"], "warn");
        assert_eq!(line["error"], "connection refused");
    }

    #[test]
    fn quotes_and_newlines_stay_one_line_of_valid_json() {
        let note = "the \"web\" release\nhas no deployed releases\t\\";
        let line = one_line(|| tracing::info!(why = note, "{note}"));
        assert_eq!(line["msg"], note);
        assert_eq!(line["why"], note);
    }

    #[test]
    fn a_record_of_the_log_crate_is_named_by_its_own_target() {
        // The fields tracing-log gives a `log` record (whose own target is
        // "log").
        let line = one_line(|| {
            tracing::warn!(
                log.target = "rustls::client",
                log.module_path = "rustls::client::hs",
                log.file = "hs.rs",
                log.line = 7,
                "m"
            );
        });
        assert_eq!(line["logger"], "rustls::client");
        let mut keys: Vec<&str> = line.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["level", "logger", "msg", "ts"]);
    }

    #[test]
    fn debug_values_are_text() {
        let outcome = Some(3);
        let line = one_line(|| tracing::info!(?outcome, "reconciled"));
        assert_eq!(line["outcome"], "Some(3)");
    }
}
