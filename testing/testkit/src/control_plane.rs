//! etcd + kube-apiserver on loopback, with RBAC authorization and
//! service-account token signing, started once per test binary.
//!
//! Inside the node sandbox ([`crate::node`]) the control plane serves a real
//! node: the apiserver also listens on the `kubernetes` Service's address and
//! port (pods dial it; no kube-proxy runs), authorizes the kubelet by the Node
//! authorizer with NodeRestriction, reaches the kubelet by its InternalIP
//! with a client certificate, and gives pods their ServiceAccount tokens.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::certs::Pki;
use crate::process::Supervised;

/// How long the control plane may take to come up: CI machines are slow and
/// the apiserver starts beside other test binaries.
pub const START_TIMEOUT: Duration = Duration::from_secs(180);

/// The running control plane of this test process.
pub struct ControlPlane {
    /// The apiserver's URL, `https://127.0.0.1:PORT`.
    pub server: String,
    /// A kubeconfig file for the admin identity (`system:masters`).
    pub kubeconfig_path: PathBuf,
    /// The directory holding certificates, data and logs; removed at exit.
    pub dir: PathBuf,
    pki: Pki,
    etcd: Mutex<Option<Supervised>>,
    apiserver: Mutex<Option<Supervised>>,
    /// How kube-apiserver was started, to start it again the same way.
    apiserver_command: (PathBuf, Vec<String>),
    /// How many times kube-apiserver was started (each start logs to a file
    /// of its own).
    apiserver_starts: std::sync::atomic::AtomicU32,
}

static CONTROL_PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The control plane of this test process, started on first use.
///
/// Safe to call from inside a tokio runtime: the start runs on its own thread.
pub fn control_plane() -> &'static ControlPlane {
    crate::started::once(
        &CONTROL_PLANE,
        "the local control plane",
        ControlPlane::start,
    )
}

/// Where `make tools` put the binaries and CRDs: `$FLUX_PLUNGER_OUT` or
/// `_out/` at the workspace root.
pub fn out_dir() -> PathBuf {
    std::env::var_os("FLUX_PLUNGER_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("_out"))
}

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testkit lives at testing/testkit")
        .to_path_buf()
}

/// `_out/bin/helm`, with its plugins, cache and config under `_out/helm` as
/// the Makefile sets them, so that a test never writes to `$HOME`.
pub fn helm() -> Result<std::process::Command> {
    let mut cmd = std::process::Command::new(tool("helm")?);
    let home = out_dir().join("helm");
    cmd.env("HELM_PLUGINS", home.join("plugins"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    Ok(cmd)
}

/// A tool built by `make tools`, or an error that says to build it.
pub fn tool(name: &str) -> Result<PathBuf> {
    let path = out_dir().join("bin").join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: run `make tools` first (it builds the pinned tools into _out/)",
            path.display()
        );
    }
    Ok(path)
}

/// A TCP port on 127.0.0.1 that was free a moment ago. Two calls may return
/// the same port: a process that needs several takes [`free_ports`].
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `N` free loopback ports, all different: each is held until all are
/// found (a port freed at once may be handed out again).
pub fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

fn wait_for_port(port: u16, server: &mut Supervised, deadline: Instant) -> Result<()> {
    while Instant::now() < deadline {
        if !server.is_running() {
            bail!("{} exited during start", server.name);
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{} did not listen on port {port} in time", server.name)
}

/// The last `lines` lines of the text file at `path` (empty if unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl ControlPlane {
    /// A second, independent control plane (a "remote cluster"), stopped
    /// when dropped or when the test process ends.
    pub fn start_another() -> Result<Self> {
        std::thread::spawn(|| ControlPlane::start_as(Flavour::Loopback))
            .join()
            .map_err(|_| anyhow::anyhow!("the control plane start thread panicked"))?
    }

    fn start() -> Result<Self> {
        Self::start_as(Flavour::of_this_process())
    }

    fn start_as(flavour: Flavour) -> Result<Self> {
        let started = Instant::now();
        let deadline = started + START_TIMEOUT;
        let etcd_bin = tool("etcd")?;
        let apiserver_bin = tool("kube-apiserver")?;
        let crd_dir = out_dir().join("crds");

        let dir = tempfile::Builder::new()
            .prefix("flux-plunger-cp-")
            .tempdir()?
            .keep();
        let pki = Pki::generate(&dir.join("pki"))?;

        let [etcd_port, etcd_peer_port] = free_ports()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer_port}");
        let etcd_args = vec![
            "--name=test".to_owned(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=test={peer_url}"),
            // Test data is thrown away: skip fsync, it is most of etcd's latency.
            "--unsafe-no-fsync=true".to_owned(),
            "--log-level=warn".to_owned(),
        ];
        // etcd's supervisor removes the whole directory once etcd has stopped.
        let mut etcd = Supervised::spawn(
            "etcd",
            &etcd_bin,
            &etcd_args,
            &dir.join("etcd.log"),
            Some(&dir),
        )?;
        wait_for_port(etcd_port, &mut etcd, deadline)
            .with_context(|| format!("etcd log:\n{}", tail(&dir.join("etcd.log"), 20)))?;

        let (bind_address, port, advertise_address) = match flavour {
            Flavour::Loopback => ("127.0.0.1", free_port()?, "127.0.0.1"),
            Flavour::Node => {
                crate::node::network::prepare()?;
                (
                    "0.0.0.0",
                    crate::node::network::KUBERNETES_SERVICE_PORT,
                    crate::node::network::NODE_IP,
                )
            }
        };
        let sa_key = pki.service_account_key.display().to_string();
        let sa_public_key = pki.service_account_public_key.display().to_string();
        let mut apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={bind_address}"),
            format!("--advertise-address={advertise_address}"),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", dir.join("apiserver-certs").display()),
            format!("--tls-cert-file={}", pki.serving_cert.display()),
            format!("--tls-private-key-file={}", pki.serving_key.display()),
            format!("--client-ca-file={}", pki.ca_cert.display()),
            // RBAC for real, so least-privilege tests mean something.
            format!("--authorization-mode={}", flavour.authorization_mode()),
            format!("--service-account-key-file={sa_public_key}"),
            format!("--service-account-signing-key-file={sa_key}"),
            "--service-account-issuer=https://kubernetes.default.svc".to_owned(),
            "--api-audiences=https://kubernetes.default.svc".to_owned(),
            "--service-cluster-ip-range=10.96.0.0/16".to_owned(),
            "--allow-privileged=true".to_owned(),
            "--enable-priority-and-fairness=false".to_owned(),
            "--profiling=false".to_owned(),
            format!("--audit-log-path={}", dir.join("audit.log").display()),
            format!(
                "--audit-policy-file={}",
                write_audit_policy(&dir)?.display()
            ),
            "--audit-log-maxsize=1000".to_owned(),
            "--v=0".to_owned(),
        ];
        apiserver_args.extend(flavour.apiserver_args(&pki, &dir)?);
        let apiserver_log = dir.join("kube-apiserver.log");
        let mut apiserver = Supervised::spawn(
            "kube-apiserver",
            &apiserver_bin,
            &apiserver_args,
            &apiserver_log,
            None,
        )?;
        let server = format!("https://127.0.0.1:{port}");
        let kubeconfig_path = dir.join("admin.kubeconfig");
        let plane = Self {
            server,
            kubeconfig_path,
            dir: dir.clone(),
            pki,
            etcd: Mutex::new(None),
            apiserver: Mutex::new(None),
            apiserver_command: (apiserver_bin.clone(), apiserver_args.clone()),
            apiserver_starts: std::sync::atomic::AtomicU32::new(1),
        };
        std::fs::write(
            &plane.kubeconfig_path,
            plane.kubeconfig_yaml(&AuthInfo::AdminCertificate),
        )?;
        let ready = wait_for_port(port, &mut apiserver, deadline).and_then(|()| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let client = plane.client().await?;
                wait_ready(&client, &mut apiserver, deadline).await?;
                install_crds(&client, &crd_dir, deadline).await
            })
        });
        if let Err(e) = ready {
            return Err(e.context(format!("kube-apiserver log:\n{}", tail(&apiserver_log, 30))));
        }
        eprintln!(
            "testkit: local control plane ready at {} in {:.1}s (kubeconfig {})",
            plane.server,
            started.elapsed().as_secs_f64(),
            plane.kubeconfig_path.display()
        );
        *plane.etcd.lock().unwrap() = Some(etcd);
        *plane.apiserver.lock().unwrap() = Some(apiserver);
        Ok(plane)
    }

    /// Pauses kube-apiserver (SIGSTOP): its port still accepts connections
    /// and it answers nothing, as a peer that went away without a word.
    /// Every client of this control plane is affected: a test that pauses
    /// the shared one runs in a test binary of its own, taking turns.
    pub fn pause_apiserver(&self) -> Result<()> {
        self.signal_apiserver("STOP")
    }

    /// Resumes a paused kube-apiserver (SIGCONT).
    pub fn resume_apiserver(&self) -> Result<()> {
        self.signal_apiserver("CONT")
    }

    fn signal_apiserver(&self, signal: &str) -> Result<()> {
        self.apiserver
            .lock()
            .unwrap()
            .as_ref()
            .context("kube-apiserver is not running")?
            .signal(signal)
    }

    /// Kills kube-apiserver: connections are refused until
    /// [`Self::start_apiserver_again`]. etcd keeps the data.
    pub fn stop_apiserver(&self) -> Result<()> {
        let mut apiserver = self
            .apiserver
            .lock()
            .unwrap()
            .take()
            .context("kube-apiserver is not running")?;
        apiserver.signal("KILL")?;
        apiserver.stop();
        Ok(())
    }

    /// Starts kube-apiserver again, on the same port with the same etcd and
    /// audit log, and waits until it is ready.
    pub async fn start_apiserver_again(&self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        let start = self
            .apiserver_starts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let log = self.dir.join(format!("kube-apiserver.{start}.log"));
        let (program, args) = &self.apiserver_command;
        let mut apiserver = Supervised::spawn("kube-apiserver", program, args, &log, None)?;
        let client = self.client().await?;
        wait_ready(&client, &mut apiserver, deadline)
            .await
            .with_context(|| format!("kube-apiserver log:\n{}", tail(&log, 30)))?;
        *self.apiserver.lock().unwrap() = Some(apiserver);
        Ok(())
    }

    /// An admin client (`system:masters`), new for the calling runtime.
    pub async fn client(&self) -> Result<Client> {
        client_from_yaml(&self.kubeconfig_yaml(&AuthInfo::AdminCertificate)).await
    }

    /// The control plane's certificates: its CA, and client certificates
    /// signed by it.
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    /// The apiserver's audit log: one JSON event per line.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// A kubeconfig document for the given identity.
    pub fn kubeconfig_yaml(&self, auth: &AuthInfo) -> String {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let user = match auth {
            AuthInfo::AdminCertificate => format!(
                "    client-certificate-data: {}\n    client-key-data: {}\n",
                b64(&self.pki.admin_cert_pem),
                b64(&self.pki.admin_key_pem)
            ),
            AuthInfo::Token(token) => format!("    token: {token}\n"),
            AuthInfo::ClientCertificate { cert, key } => format!(
                "    client-certificate-data: {}\n    client-key-data: {}\n",
                b64(cert),
                b64(key)
            ),
        };
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {}\n    certificate-authority-data: {}\ncontexts:\n- name: local\n  context:\n    cluster: local\n    user: user\n    namespace: default\ncurrent-context: local\nusers:\n- name: user\n  user:\n{user}",
            self.server,
            b64(&self.pki.ca_cert_pem)
        )
    }

    /// Writes a kubeconfig file for `auth` at `path`, for a process (one of
    /// our binaries, helm, kubectl) to use.
    pub fn write_kubeconfig(&self, path: &Path, auth: &AuthInfo) -> Result<()> {
        std::fs::write(path, self.kubeconfig_yaml(auth))?;
        Ok(())
    }

    /// A bearer token for `namespace/service_account` (created if missing),
    /// so a test can act with exactly the RBAC granted to it.
    pub async fn service_account_token(
        &self,
        admin: &Client,
        namespace: &str,
        service_account: &str,
    ) -> Result<String> {
        let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
        create_unless_present(&accounts, service_account).await?;
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec!["https://kubernetes.default.svc".to_owned()],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let response = accounts
            .create_token_request(service_account, &PostParams::default(), &request)
            .await?;
        Ok(response
            .status
            .context("TokenRequest returned no status")?
            .token)
    }

    /// Writes a kubeconfig at `path` that acts as `namespace/service_account`
    /// (created if missing) with a bearer token, the way a pod's mounted
    /// token would; returns the username the audit log records for it.
    pub async fn write_service_account_kubeconfig(
        &self,
        admin: &Client,
        namespace: &str,
        service_account: &str,
        path: &Path,
    ) -> Result<String> {
        let token = self
            .service_account_token(admin, namespace, service_account)
            .await?;
        self.write_kubeconfig(path, &AuthInfo::Token(token))?;
        Ok(service_account_user(namespace, service_account))
    }

    /// Binds `cluster-admin` to the ServiceAccounts `accounts` of `namespace`
    /// (a test that reads one identity's requests from the audit log but
    /// does not test RBAC); returns the ClusterRoleBinding's name.
    pub async fn grant_cluster_admin(
        &self,
        admin: &Client,
        namespace: &str,
        accounts: &[&str],
    ) -> Result<String> {
        let name = format!("{namespace}-{}-cluster-admin", accounts.join("-"));
        let binding = ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".to_owned(),
                kind: "ClusterRole".to_owned(),
                name: "cluster-admin".to_owned(),
            },
            subjects: Some(
                accounts
                    .iter()
                    .map(|account| Subject {
                        kind: "ServiceAccount".to_owned(),
                        name: (*account).to_owned(),
                        namespace: Some(namespace.to_owned()),
                        ..Default::default()
                    })
                    .collect(),
            ),
        };
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(&PostParams::default(), &binding)
            .await?;
        Ok(name)
    }

    /// A client acting as `namespace/service_account`.
    pub async fn service_account_client(
        &self,
        admin: &Client,
        namespace: &str,
        service_account: &str,
    ) -> Result<Client> {
        let token = self
            .service_account_token(admin, namespace, service_account)
            .await?;
        client_from_yaml(&self.kubeconfig_yaml(&AuthInfo::Token(token))).await
    }
}

/// Creates the object `name` with nothing but its name, unless it exists.
pub(crate) async fn create_unless_present<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: kube::Resource
        + Default
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let mut object = K::default();
    object.meta_mut().name = Some(name.to_owned());
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Who a kubeconfig authenticates as.
pub enum AuthInfo {
    AdminCertificate,
    Token(String),
    /// A client certificate and key (PEM), e.g. from [`Pki::client_certificate`].
    ClientCertificate {
        cert: String,
        key: String,
    },
}

/// What the control plane serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flavour {
    /// Tests and tools on loopback; no node, so no ServiceAccount admission
    /// (no controller-manager gives namespaces their default ServiceAccount:
    /// the plugin would refuse every pod).
    Loopback,
    /// A real node beside it, in the node sandbox.
    Node,
}

impl Flavour {
    fn of_this_process() -> Self {
        if crate::node::sandbox::name().is_some() {
            Flavour::Node
        } else {
            Flavour::Loopback
        }
    }

    fn authorization_mode(self) -> &'static str {
        match self {
            Flavour::Loopback => "RBAC",
            // The kubelet's identity may read only what its own pods use.
            Flavour::Node => "Node,RBAC",
        }
    }

    fn apiserver_args(self, pki: &Pki, dir: &Path) -> Result<Vec<String>> {
        Ok(match self {
            Flavour::Loopback => vec!["--disable-admission-plugins=ServiceAccount".to_owned()],
            Flavour::Node => {
                let (cert, key) = pki
                    .client_certificate("kube-apiserver-kubelet-client", Some("system:masters"))?;
                let cert_path = dir.join("pki").join("kubelet-client.crt");
                let key_path = dir.join("pki").join("kubelet-client.key");
                std::fs::write(&cert_path, cert)?;
                std::fs::write(&key_path, key)?;
                vec![
                    "--enable-admission-plugins=NodeRestriction".to_owned(),
                    "--kubelet-preferred-address-types=InternalIP".to_owned(),
                    format!("--kubelet-client-certificate={}", cert_path.display()),
                    format!("--kubelet-client-key={}", key_path.display()),
                ]
            }
        })
    }
}

pub(crate) async fn client_from_yaml(yaml: &str) -> Result<Client> {
    let kubeconfig = Kubeconfig::from_yaml(yaml)?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

fn write_audit_policy(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("audit-policy.yaml");
    // Request bodies of HelmRelease writes (status included), so a test can
    // check what every write carried; metadata for everything else: who did what to which
    // object, enough to count requests by verb and to prove who wrote when.
    std::fs::write(
        &path,
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Request\n  verbs: [patch, update, create]\n  resources:\n  - group: helm.toolkit.fluxcd.io\n    resources: [helmreleases, helmreleases/status]\n- level: Metadata\n",
    )?;
    Ok(path)
}

async fn wait_ready(client: &Client, apiserver: &mut Supervised, deadline: Instant) -> Result<()> {
    loop {
        let request = http::Request::get("/readyz").body(Vec::new())?;
        match client.request_text(request).await {
            Ok(body) if body.trim() == "ok" => return Ok(()),
            _ if Instant::now() > deadline => bail!("kube-apiserver was not ready in time"),
            _ if !apiserver.is_running() => bail!("kube-apiserver exited during start"),
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

async fn install_crds(client: &Client, dir: &Path, deadline: Instant) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut names = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("{} is missing: run `make tools`", dir.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc)?;
            if value.is_null() {
                continue;
            }
            let crd: CustomResourceDefinition = serde_yaml::from_value(value)
                .with_context(|| format!("parsing {}", path.display()))?;
            let name = crd.metadata.name.clone().context("CRD without a name")?;
            crds.patch(
                &name,
                &PatchParams::apply("testkit").force(),
                &Patch::Apply(&crd),
            )
            .await
            .with_context(|| format!("installing CRD {name}"))?;
            names.push(name);
        }
    }
    if names.is_empty() {
        bail!("no CRD found in {}: run `make tools`", dir.display());
    }
    for name in names {
        loop {
            let crd = crds.get(&name).await?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            if Instant::now() > deadline {
                bail!("CRD {name} was not established in time");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

use serde::Deserialize;

/// A binary of this workspace, built beside the running test (`cargo test
/// --workspace` builds every package's binaries).
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // A test binary lives in target/<profile>/deps, a binary (the demo, the
    // bench) in target/<profile>.
    let mut dir = exe
        .parent()
        .context("the running binary has no directory")?;
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent().context("deps/ has no parent")?;
    }
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: build it with `cargo build -p {name}` (make test does)",
            path.display()
        );
    }
    Ok(path)
}

/// The ServiceAccount's username as the apiserver authenticates its tokens.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}
