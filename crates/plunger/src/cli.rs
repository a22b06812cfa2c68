//! Flag groups shared by the three binaries, in Flux's style, flattened into
//! each binary's own clap definition.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::client::bounded;
use crate::timings::{GracePeriodError, REQUEST_TIMEOUT, Timings};

/// How to reach the apiserver.
#[derive(Args, Debug, Clone, Default)]
pub struct KubeArgs {
    /// Path to a kubeconfig file. Without it: $KUBECONFIG, the in-cluster
    /// service account, then ~/.kube/config.
    #[arg(long, value_name = "PATH")]
    pub(crate) kubeconfig: Option<PathBuf>,
}

impl KubeArgs {
    /// A client for the configured cluster; every request but a watch is
    /// bounded by `timings::REQUEST_TIMEOUT`.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        Ok(bounded(self.config().await?, REQUEST_TIMEOUT)?)
    }

    /// A client for a writer under the leader Lease: bounded like
    /// [`Self::client`], and every write held back while `leadership` is not
    /// current (`plunger::client::bounded_writer`).
    pub async fn writer_client(
        &self,
        leadership: tokio::sync::watch::Receiver<crate::lease::Leadership>,
    ) -> anyhow::Result<kube::Client> {
        Ok(crate::client::bounded_writer(
            self.config().await?,
            REQUEST_TIMEOUT,
            leadership,
        )?)
    }

    /// A client for the configured cluster, once its apiserver has answered
    /// (`/version`, open to every identity). A kubeconfig that points nowhere
    /// fails here, naming the server, after `patience` of retries, instead of
    /// as an endless stream of connection errors from a process that looks
    /// alive.
    pub async fn answering_client(
        &self,
        patience: std::time::Duration,
    ) -> anyhow::Result<kube::Client> {
        let config = self.config().await?;
        let server = config.cluster_url.to_string();
        let client = bounded(config, REQUEST_TIMEOUT)?;
        let deadline = std::time::Instant::now() + patience;
        loop {
            match client.apiserver_version().await {
                Ok(_) => return Ok(client),
                Err(err) if std::time::Instant::now() < deadline => {
                    tracing::warn!(%server, error = %err, "the apiserver does not answer yet; trying again");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                Err(err) => {
                    let source = match &self.kubeconfig {
                        Some(path) => format!(" (from --kubeconfig {})", path.display()),
                        None => String::new(),
                    };
                    anyhow::bail!(
                        "the apiserver at {server}{source} did not answer for {}s: {err}",
                        patience.as_secs()
                    )
                }
            }
        }
    }

    async fn config(&self) -> anyhow::Result<kube::Config> {
        use anyhow::Context;
        let config = match &self.kubeconfig {
            Some(path) => {
                let kubeconfig = kube::config::Kubeconfig::read_from(path)
                    .with_context(|| format!("--kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                    .await
                    .with_context(|| format!("--kubeconfig {}", path.display()))?
            }
            None => kube::Config::infer().await.context(
                "no usable cluster configuration (in-cluster, $KUBECONFIG or ~/.kube/config)",
            )?,
        };
        Ok(config)
    }
}

/// Log format, as Flux's controllers name it.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogEncoding {
    #[default]
    Json,
    Console,
}

/// Log level.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogLevel {
    Trace,
    Debug,
    #[default]
    Info,
    Warn,
    Error,
}

/// Logging flags.
#[derive(Args, Debug, Clone, Default)]
pub struct LogArgs {
    /// Log verbosity.
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
    /// Log format: one JSON object a line in the shape Flux's controllers
    /// write (`level`, `ts`, `logger`, `msg`, ...), or human-readable text.
    #[arg(long, value_enum, default_value_t = LogEncoding::Json)]
    pub log_encoding: LogEncoding,
}

impl LogArgs {
    /// Installs the global tracing subscriber (stderr).
    pub fn init(&self) {
        let level = match self.log_level {
            LogLevel::Trace => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        };
        // Our crates at the chosen level, the libraries at warn; RUST_LOG,
        // when set, overrides both (for debugging a library).
        let directives = std::env::var("RUST_LOG").unwrap_or_else(|_| {
            format!(
                "warn,plunger={level},flux_plunger={level},flux_plunger_drain={level},flux_plunger_sweep={level}"
            )
        });
        let filter = tracing_subscriber::EnvFilter::try_new(directives)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        // Colours only for a person at a terminal: in a file, a pipe or
        // `kubectl logs` the escape codes would be noise.
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr);
        // A second init (tests) is harmless: keep the first subscriber.
        let _ = match self.log_encoding {
            LogEncoding::Json => builder.event_format(crate::logs::FluxJson).try_init(),
            LogEncoding::Console => builder.try_init(),
        };
    }
}

/// The Lease that keeps a single writer (SPEC §6).
#[derive(Args, Debug, Clone)]
pub struct LeaseArgs {
    /// Namespace of the leader Lease (the chart's release namespace).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub leader_election_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = "flux-plunger", value_name = "NAME")]
    pub leader_election_lease_name: String,
    /// This pod's name, the Lease holder identity (the chart passes it
    /// through the downward API); the hostname when unset.
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pod_name: Option<String>,
}

impl LeaseArgs {
    /// The Lease's namespace, or an error that names the flag and says why
    /// it is needed.
    pub fn namespace(&self, why: &str) -> anyhow::Result<String> {
        self.leader_election_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                anyhow::anyhow!("--leader-election-namespace (or POD_NAMESPACE) is required: {why}")
            })
    }

    /// The install these flags belong to, named by its Lease (SPEC §3: the
    /// value of the fence's label); without a Lease namespace, the value
    /// every install wrote before the label named one.
    pub fn install(&self) -> crate::install::Install {
        match self
            .leader_election_namespace
            .as_deref()
            .filter(|n| !n.is_empty())
        {
            Some(namespace) => {
                crate::install::Install::from_lease(namespace, &self.leader_election_lease_name)
            }
            None => crate::install::Install::legacy(),
        }
    }

    /// The holder identity: the pod name, else the hostname.
    pub fn identity(&self) -> String {
        self.pod_name
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
            })
            .unwrap_or_else(|| "flux-plunger".to_owned())
    }
}

/// The one timing value (SPEC §7).
#[derive(Args, Debug, Clone)]
pub struct GraceArgs {
    /// The pod's termination grace period in whole seconds, 40 to 140. Every
    /// other timing (drain deadline, Lease, hook waits) derives from it.
    #[arg(
        long = "shutdown-grace-period-seconds",
        default_value_t = Timings::default(),
        value_parser = parse_timings,
        value_name = "SECONDS"
    )]
    pub timings: Timings,
}

fn parse_timings(text: &str) -> Result<Timings, GracePeriodError> {
    Timings::parse_grace_period(text)
}

/// Parses a listen address the way Flux's controllers accept it: `:8080`
/// means every interface.
pub fn parse_listen_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    let full = if text.starts_with(':') {
        format!("0.0.0.0{text}")
    } else {
        text.to_owned()
    };
    full.parse()
        .map_err(|_| format!("{text:?} is not a listen address (HOST:PORT or :PORT)"))
}

/// Whose access bounds flux-plunger's in a release's storage; shared by the
/// controller and the drain, which both read storage (the chart passes both
/// the same value).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TenancyArgs {
    /// The ServiceAccount helm-controller impersonates for a HelmRelease
    /// that names none (helm-controller's own --default-service-account, set
    /// by Flux's multi-tenancy lockdown). The storage of a release outside
    /// its own namespace is touched only where the release's ServiceAccount,
    /// else this one, in the release's namespace, may list, get and delete
    /// Secrets.
    #[arg(long, value_name = "NAME", value_parser = parse_service_account_name)]
    pub default_service_account: Option<String>,
}

/// A ServiceAccount name: a DNS subdomain, as the apiserver requires.
fn parse_service_account_name(name: &str) -> Result<String, String> {
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{name:?} is not a ServiceAccount name (a lower-case DNS subdomain)"
        ))
    }
}

/// Where events also go.
#[derive(Args, Debug, Clone, Default)]
pub struct EventsArgs {
    /// Also post every event to Flux's notification-controller at this
    /// http:// address (as Flux's controllers do), so Flux Alerts fire on
    /// flux-plunger's recoveries and warnings.
    #[arg(long, value_name = "URL", value_parser = parse_events_addr)]
    pub events_addr: Option<String>,
}

impl EventsArgs {
    /// The event recorder these flags ask for.
    pub fn events(&self, client: kube::Client, instance: &str) -> crate::events::Events {
        let events = crate::events::Events::new(client, "flux-plunger", Some(instance.to_owned()));
        match self
            .events_addr
            .as_deref()
            .and_then(|a| crate::notify::Forwarder::new(a, Some(instance.to_owned())).ok())
        {
            Some(forwarder) => events.forwarding_to(forwarder),
            None => events,
        }
    }
}

fn parse_events_addr(text: &str) -> Result<String, String> {
    crate::notify::Forwarder::new(text, None).map(|_| text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_listens_on_every_interface() {
        assert_eq!(
            parse_listen_addr(":8080").unwrap().to_string(),
            "0.0.0.0:8080"
        );
        assert_eq!(
            parse_listen_addr("127.0.0.1:9").unwrap().to_string(),
            "127.0.0.1:9"
        );
        assert!(parse_listen_addr("8080").unwrap_err().contains("\"8080\""));
    }

    #[test]
    fn a_default_service_account_must_be_a_service_account_name() {
        assert_eq!(
            parse_service_account_name("tenant-deployer"),
            Ok("tenant-deployer".to_owned())
        );
        for bad in ["", "Deployer", "-x", "x-", "a/b", "../etc"] {
            assert!(parse_service_account_name(bad).is_err(), "{bad:?}");
        }
    }
}
