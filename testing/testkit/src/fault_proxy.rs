//! A fault-injecting proxy between a kube client (or one of our binaries)
//! and the local apiserver: connection resets, 500s, 503s, 409s, 429s with
//! `Retry-After`, and latency, each at a seeded rate, per verb.
//!
//! The proxy listens on plain HTTP on loopback and forwards upstream over
//! TLS with the credentials of the `kube::Config` it was started with: the
//! clients it hands out need no certificates, and the identity the
//! apiserver sees (admin or a ServiceAccount's token) is the upstream's.
//!
//! Where a fault lands matters for what it means:
//! - every fault but one is injected **before** forwarding: the apiserver
//!   never saw the request, so a 409 on a write is as sound as a real one
//!   (nothing was written);
//! - `ResetAfterForward` forwards first and then drops the connection with a
//!   TCP reset instead of the answer: the write happened and the client does
//!   not know. This is the realistic, nasty one.
//!
//! Watches stream through untouched: a fault may refuse a watch before it
//! starts, never cut one that is running.
//!
//! Beside the seeded faults, a plan may **hold** chosen requests (by verb,
//! path and body, not by chance): a black hole accepts a request and never
//! answers nor forwards it (a peer that went away without a word), and a slow
//! answer forwards the request at once but answers only after a delay (the
//! write happened; the client hears of it late, or never if it gave up).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use kube::client::Body;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::seeded::SeededRng;

/// The verbs faults are configured by, as the apiserver's RBAC names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
}

impl Verb {
    pub const ALL: [Verb; 7] = [
        Verb::Get,
        Verb::List,
        Verb::Watch,
        Verb::Create,
        Verb::Update,
        Verb::Patch,
        Verb::Delete,
    ];

    pub fn is_write(self) -> bool {
        matches!(
            self,
            Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
        }
    }

    /// The verb of a request to the apiserver, from its method and URL.
    pub fn of(method: &Method, uri: &Uri) -> Verb {
        match *method {
            Method::POST => Verb::Create,
            Method::PUT => Verb::Update,
            Method::PATCH => Verb::Patch,
            Method::DELETE => Verb::Delete,
            _ if is_watch(uri) => Verb::Watch,
            _ if is_collection(uri.path()) => Verb::List,
            _ => Verb::Get,
        }
    }
}

fn is_watch(uri: &Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

/// `/api/v1/[namespaces/NS/]RESOURCE` or `/apis/G/V/[namespaces/NS/]RESOURCE`:
/// a collection; one more segment names an object.
fn is_collection(path: &str) -> bool {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest = match segments.first() {
        Some(&"api") if segments.len() >= 2 => &segments[2..],
        Some(&"apis") if segments.len() >= 3 => &segments[3..],
        _ => return false,
    };
    let rest = if rest.len() >= 3 && rest[0] == "namespaces" {
        &rest[2..]
    } else {
        rest
    };
    rest.len() == 1
}

/// The faults the proxy injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// The connection is reset before the request is forwarded.
    ResetBeforeForward,
    /// The request is forwarded, then the connection is reset instead of
    /// answering: a write happened that the client does not know of.
    ResetAfterForward,
    /// 500 Internal Server Error, not forwarded.
    InternalError,
    /// 503 Service Unavailable, not forwarded.
    Unavailable,
    /// 409 Conflict on a write, not forwarded (so nothing was written).
    Conflict,
    /// 429 Too Many Requests with `Retry-After`, not forwarded.
    TooManyRequests,
    /// A delay before forwarding (combines with the others).
    Latency,
    /// A [`Hold`] without an answer: accepted, never forwarded, never answered.
    BlackHole,
    /// A [`Hold`] with an answer: forwarded at once, answered late.
    SlowAnswer,
    /// A [`Hold`] answered with a body of its own, never forwarded: what a
    /// hostile server sends.
    CraftedAnswer,
}

impl Fault {
    pub const ALL: [Fault; 10] = [
        Fault::ResetBeforeForward,
        Fault::ResetAfterForward,
        Fault::InternalError,
        Fault::Unavailable,
        Fault::Conflict,
        Fault::TooManyRequests,
        Fault::Latency,
        Fault::BlackHole,
        Fault::SlowAnswer,
        Fault::CraftedAnswer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::ResetBeforeForward => "reset-before",
            Fault::ResetAfterForward => "reset-after",
            Fault::InternalError => "500",
            Fault::Unavailable => "503",
            Fault::Conflict => "409",
            Fault::TooManyRequests => "429",
            Fault::Latency => "latency",
            Fault::BlackHole => "black-hole",
            Fault::SlowAnswer => "slow-answer",
            Fault::CraftedAnswer => "crafted-answer",
        }
    }
}

/// The rate (0..=1) of each fault for one verb. The failures (everything but
/// latency) exclude each other: their rates add up to the chance that a
/// request fails. A 409 is only ever injected on a write, a reset after
/// forwarding never on a watch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub reset_before: f64,
    pub reset_after: f64,
    pub internal_error: f64,
    pub unavailable: f64,
    pub conflict: f64,
    pub too_many_requests: f64,
    pub latency: f64,
}

impl Rates {
    /// Every fault at `rate`.
    pub fn all(rate: f64) -> Self {
        Self {
            reset_before: rate,
            reset_after: rate,
            internal_error: rate,
            unavailable: rate,
            conflict: rate,
            too_many_requests: rate,
            latency: rate,
        }
    }

    fn failures(&self, verb: Verb) -> [(Fault, f64); 6] {
        let only_if = |ok: bool, rate: f64| if ok { rate } else { 0.0 };
        [
            (Fault::ResetBeforeForward, self.reset_before),
            (
                Fault::ResetAfterForward,
                only_if(verb != Verb::Watch, self.reset_after),
            ),
            (Fault::InternalError, self.internal_error),
            (Fault::Unavailable, self.unavailable),
            (Fault::Conflict, only_if(verb.is_write(), self.conflict)),
            (Fault::TooManyRequests, self.too_many_requests),
        ]
    }
}

/// Requests the proxy holds instead of answering: those of `verb` whose path
/// ends with `path_suffix` and whose body contains none of `body_lacks`, the
/// first `times` of them (every one for `None`).
#[derive(Debug, Clone)]
pub struct Hold {
    pub verb: Verb,
    pub path_suffix: String,
    pub body_lacks: Vec<String>,
    pub times: Option<u32>,
    /// `None`: a black hole (never forwarded, never answered); `Some(d)`:
    /// forwarded at once, answered `d` later.
    pub answer_after: Option<Duration>,
    /// Answered at once with this status instead, never forwarded (an
    /// apiserver that keeps failing one request).
    pub fail_with: Option<u16>,
    /// Answered at once with this status and JSON body, never forwarded
    /// (a hostile server).
    pub answer_with: Option<(u16, Bytes)>,
}

impl Hold {
    /// Every `verb` request to a path ending with `path_suffix` goes
    /// unanswered, forever.
    pub fn black_hole(verb: Verb, path_suffix: &str) -> Self {
        Self {
            verb,
            path_suffix: path_suffix.to_owned(),
            body_lacks: Vec::new(),
            times: None,
            answer_after: None,
            fail_with: None,
            answer_with: None,
        }
    }

    /// Every `verb` request to a path ending with `path_suffix` is forwarded
    /// and answered `delay` later.
    pub fn slow_answer(verb: Verb, path_suffix: &str, delay: Duration) -> Self {
        Self {
            answer_after: Some(delay),
            ..Self::black_hole(verb, path_suffix)
        }
    }

    /// Every `verb` request to a path ending with `path_suffix` is answered
    /// with `code` (500 or 503), never forwarded.
    pub fn failing(verb: Verb, path_suffix: &str, code: u16) -> Self {
        Self {
            fail_with: Some(code),
            ..Self::black_hole(verb, path_suffix)
        }
    }

    /// Every `verb` request to a path ending with `path_suffix` is answered
    /// with `code` and `body` (JSON), never forwarded.
    pub fn answering(verb: Verb, path_suffix: &str, code: u16, body: Bytes) -> Self {
        Self {
            answer_with: Some((code, body)),
            ..Self::black_hole(verb, path_suffix)
        }
    }

    /// Only the first `times` matching requests.
    pub fn times(mut self, times: u32) -> Self {
        self.times = Some(times);
        self
    }

    /// Only requests whose body does not contain `text` (nor any text given
    /// before).
    pub fn body_lacks(mut self, text: &str) -> Self {
        self.body_lacks.push(text.to_owned());
        self
    }

    fn matches(&self, verb: Verb, path: &str, body: &[u8]) -> bool {
        verb == self.verb
            && path.ends_with(&self.path_suffix)
            && self.body_lacks.iter().all(|text| {
                text.is_empty() || !body.windows(text.len()).any(|w| w == text.as_bytes())
            })
    }

    fn fault(&self) -> Fault {
        if self.answer_with.is_some() {
            return Fault::CraftedAnswer;
        }
        match (self.fail_with, self.answer_after) {
            (Some(503), _) => Fault::Unavailable,
            (Some(_), _) => Fault::InternalError,
            (None, None) => Fault::BlackHole,
            (None, Some(_)) => Fault::SlowAnswer,
        }
    }
}

/// What the proxy injects: a seed, the rates per verb (a verb not listed
/// gets none), the longest injected delay, the `Retry-After` of a 429, and
/// the requests it holds.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    pub seed: u64,
    pub rates: BTreeMap<Verb, Rates>,
    pub max_latency: Duration,
    pub retry_after_seconds: u32,
    pub holds: Vec<Hold>,
}

impl FaultPlan {
    /// No faults at all: a plain proxy.
    pub fn none(seed: u64) -> Self {
        Self {
            seed,
            rates: BTreeMap::new(),
            max_latency: Duration::from_millis(100),
            retry_after_seconds: 1,
            holds: Vec::new(),
        }
    }

    /// Also holds the requests `hold` picks.
    pub fn holding(mut self, hold: Hold) -> Self {
        self.holds.push(hold);
        self
    }

    /// The same rates for every verb.
    pub fn every_verb(seed: u64, rates: Rates) -> Self {
        Self::none(seed).with_verbs(&Verb::ALL, rates)
    }

    /// `rates` for each of `verbs`.
    pub fn with_verbs(mut self, verbs: &[Verb], rates: Rates) -> Self {
        for verb in verbs {
            self.rates.insert(*verb, rates);
        }
        self
    }

    fn draw(&self, verb: Verb, rng: &mut SeededRng) -> Draw {
        let Some(rates) = self.rates.get(&verb) else {
            return Draw::default();
        };
        // One draw picks at most one failure; latency is drawn on its own,
        // so a delayed request may also fail.
        let roll = rng.unit();
        let latency_roll = rng.unit();
        let delay = rng.delay_up_to(self.max_latency);
        let mut below = 0.0;
        let failure = rates.failures(verb).into_iter().find_map(|(fault, rate)| {
            below += rate;
            (roll < below).then_some(fault)
        });
        Draw {
            failure,
            latency: (latency_roll < rates.latency).then_some(delay),
        }
    }
}

#[derive(Debug, Default)]
struct Draw {
    failure: Option<Fault>,
    latency: Option<Duration>,
}

/// What a proxy saw and did: requests by verb, injected faults by kind and
/// verb. Tests print it, and add up the reports of many runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultReport {
    pub requests: BTreeMap<Verb, u64>,
    pub faults: BTreeMap<(Fault, Verb), u64>,
    /// Bytes of the answers' bodies passed back to clients (what the
    /// apiserver sent them, plus the proxy's own few injected answers).
    pub response_bytes: u64,
}

impl FaultReport {
    /// Injected faults of one kind, over every verb.
    pub fn count(&self, fault: Fault) -> u64 {
        self.faults
            .iter()
            .filter(|((f, _), _)| *f == fault)
            .map(|(_, n)| n)
            .sum()
    }

    /// Injected faults of every kind.
    pub fn total_faults(&self) -> u64 {
        self.faults.values().sum()
    }

    pub fn total_requests(&self) -> u64 {
        self.requests.values().sum()
    }

    /// Adds `other` into this one.
    pub fn merge(&mut self, other: &FaultReport) {
        for (verb, n) in &other.requests {
            *self.requests.entry(*verb).or_default() += n;
        }
        for (key, n) in &other.faults {
            *self.faults.entry(*key).or_default() += n;
        }
        self.response_bytes += other.response_bytes;
    }
}

impl fmt::Display for FaultReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} requests (", self.total_requests())?;
        let requests: Vec<String> = self
            .requests
            .iter()
            .map(|(verb, n)| format!("{} {n}", verb.name()))
            .collect();
        write!(
            f,
            "{}), {} faults (",
            requests.join(", "),
            self.total_faults()
        )?;
        let faults: Vec<String> = Fault::ALL
            .iter()
            .map(|fault| format!("{} {}", fault.name(), self.count(*fault)))
            .collect();
        write!(f, "{})", faults.join(", "))
    }
}

/// A running proxy; it stops (and drops every connection) when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

struct Shared {
    upstream: kube::Client,
    plan: FaultPlan,
    rng: Mutex<SeededRng>,
    enabled: AtomicBool,
    report: Mutex<FaultReport>,
    /// How many requests each of `plan.holds` has caught.
    held: Mutex<Vec<u32>>,
    response_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the connection tasks: aborting it ends them.
        self.accept.abort();
    }
}

impl FaultProxy {
    /// A proxy in front of this test process's control plane, forwarding as
    /// the admin (`system:masters`).
    pub async fn in_front_of_control_plane(plan: FaultPlan) -> Result<Self> {
        let plane = crate::control_plane();
        let yaml = plane.kubeconfig_yaml(&crate::control_plane::AuthInfo::AdminCertificate);
        Self::forwarding_as(&yaml, plan).await
    }

    /// A proxy forwarding with the server and credentials of the kubeconfig
    /// document `yaml` (e.g. [`crate::guard::Guarded::controller_kubeconfig`]).
    pub async fn forwarding_as(yaml: &str, plan: FaultPlan) -> Result<Self> {
        let kubeconfig = kube::config::Kubeconfig::from_yaml(yaml)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        Self::start(config, plan).await
    }

    /// A proxy forwarding to `upstream` with its credentials.
    pub async fn start(mut upstream: kube::Config, plan: FaultPlan) -> Result<Self> {
        // The proxy passes on what the apiserver says: it must not retry a
        // real 429 or 503 itself, nor hide one.
        upstream.default_retry = false;
        let upstream = kube::Client::try_from(upstream).context("the proxy's upstream client")?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the fault proxy to 127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            rng: Mutex::new(SeededRng::fork(plan.seed, "fault-proxy")),
            held: Mutex::new(vec![0; plan.holds.len()]),
            response_bytes: Arc::default(),
            plan,
            enabled: AtomicBool::new(true),
            report: Mutex::default(),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self {
            addr,
            shared,
            accept,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client that goes through the proxy. It keeps kube's default retry
    /// of 429/503/504, as every binary of ours has it.
    pub fn client(&self) -> Result<kube::Client> {
        let config = kube::Config::new(self.url().parse()?);
        Ok(kube::Client::try_from(config)?)
    }

    /// A kubeconfig for a process (one of our binaries) to go through the
    /// proxy: no credentials, the proxy adds its own.
    pub fn kubeconfig_yaml(&self, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: proxy\n  cluster:\n    server: {}\ncontexts:\n- name: proxy\n  context:\n    cluster: proxy\n    user: proxy\n    namespace: {namespace}\ncurrent-context: proxy\nusers:\n- name: proxy\n  user: {{}}\n",
            self.url()
        )
    }

    /// Turns injection on or off (requests still go through and are counted).
    pub fn set_enabled(&self, enabled: bool) {
        self.shared.enabled.store(enabled, Ordering::SeqCst);
    }

    /// What the proxy saw and injected so far.
    pub fn report(&self) -> FaultReport {
        let mut report = self.shared.report.lock().unwrap().clone();
        report.response_bytes = self.shared.response_bytes.load(Ordering::SeqCst);
        report
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of descriptors, most likely: give connections time to end.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                connections.spawn(serve_connection(stream, shared.clone()));
            }
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// An answer's body, its bytes counted as they pass.
struct Counted {
    inner: Body,
    bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl hyper::body::Body for Counted {
    type Data = Bytes;
    type Error = kube::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, kube::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.bytes
                .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A second handle on a connection's socket, kept to reset it: `SO_LINGER`
/// of zero turns the close that follows into a TCP RST.
type ResetHandle = Arc<Mutex<Option<std::net::TcpStream>>>;

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let Ok((stream, reset)) = with_reset_handle(stream) else {
        return;
    };
    let service = hyper::service::service_fn(move |request| {
        let counter = shared.response_bytes.clone();
        let answer = handle(shared.clone(), reset.clone(), request);
        async move {
            answer.await.map(|response| {
                response.map(|inner| Counted {
                    inner,
                    bytes: counter,
                })
            })
        }
    });
    // Keep-alive connections idle as long as the client likes: no header
    // read timeout (it would need a timer, and a client's pool is not a fault).
    let _ = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

fn with_reset_handle(stream: TcpStream) -> std::io::Result<(TcpStream, ResetHandle)> {
    let std_stream = stream.into_std()?;
    let twin = std_stream.try_clone()?;
    Ok((
        TcpStream::from_std(std_stream)?,
        Arc::new(Mutex::new(Some(twin))),
    ))
}

/// The error a service returns to make hyper drop the connection unanswered.
#[derive(Debug)]
struct InjectedReset;

impl fmt::Display for InjectedReset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("fault proxy: injected connection reset")
    }
}

impl std::error::Error for InjectedReset {}

fn reset(handle: &ResetHandle) -> InjectedReset {
    if let Some(twin) = handle.lock().unwrap().take() {
        // Linger is a property of the socket, not of this descriptor: once
        // hyper closes its own, the peer gets a reset, not a clean end.
        let _ = TcpSocket::from_std_stream(twin).set_zero_linger();
    }
    InjectedReset
}

async fn handle(
    shared: Arc<Shared>,
    reset_handle: ResetHandle,
    request: Request<Incoming>,
) -> Result<Response<Body>, InjectedReset> {
    let verb = Verb::of(request.method(), request.uri());
    // Request bodies are small JSON documents: read whole, so a hold can
    // look into them and the upstream client may retry them.
    let (parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Err(reset(&reset_handle));
    };
    if let Some(hold) = shared.take_hold(verb, parts.uri.path(), &body) {
        return held(&shared, hold, parts, body).await;
    }
    pass(shared, reset_handle, verb, parts, body).await
}

/// Answers a request a [`Hold`] caught: never, or after its delay.
async fn held(
    shared: &Shared,
    hold: Hold,
    parts: http::request::Parts,
    body: Bytes,
) -> Result<Response<Body>, InjectedReset> {
    if let Some((code, body)) = hold.answer_with {
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::from_u16(code).expect("a valid status code");
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        return Ok(response);
    }
    if let Some(code) = hold.fail_with {
        return Ok(status(
            code,
            "InternalError",
            "fault proxy: a held request answered with a failure (not forwarded)",
            None,
        ));
    }
    let Some(delay) = hold.answer_after else {
        // The connection stays open and silent until the client gives up
        // (or the proxy is dropped).
        return std::future::pending().await;
    };
    let response = forward(&shared.upstream, parts, body).await;
    tokio::time::sleep(delay).await;
    Ok(response.unwrap_or_else(|err| {
        status(
            502,
            "InternalError",
            &format!("fault proxy: upstream failed: {err:#}"),
            None,
        )
    }))
}

async fn pass(
    shared: Arc<Shared>,
    reset_handle: ResetHandle,
    verb: Verb,
    parts: http::request::Parts,
    body: Bytes,
) -> Result<Response<Body>, InjectedReset> {
    let draw = if shared.enabled.load(Ordering::SeqCst) {
        shared.plan.draw(verb, &mut shared.rng.lock().unwrap())
    } else {
        Draw::default()
    };
    shared.record(verb, &draw);
    if let Some(delay) = draw.latency {
        tokio::time::sleep(delay).await;
    }
    let message = |what: &str| {
        format!(
            "fault proxy: injected {what} for {} {} (not forwarded)",
            verb.name(),
            parts.uri.path()
        )
    };
    match draw.failure {
        Some(Fault::ResetBeforeForward) => return Err(reset(&reset_handle)),
        Some(Fault::InternalError) => {
            return Ok(status(500, "InternalError", &message("500"), None));
        }
        Some(Fault::Unavailable) => {
            return Ok(status(503, "ServiceUnavailable", &message("503"), None));
        }
        Some(Fault::Conflict) => {
            let note = message(
                "409: the object has been modified; please apply your changes to the latest version and try again",
            );
            return Ok(status(409, "Conflict", &note, None));
        }
        Some(Fault::TooManyRequests) => {
            let seconds = shared.plan.retry_after_seconds;
            return Ok(status(
                429,
                "TooManyRequests",
                &message("429"),
                Some(seconds),
            ));
        }
        // Holds are never drawn: `take_hold` picks them before any draw.
        Some(
            Fault::ResetAfterForward
            | Fault::Latency
            | Fault::BlackHole
            | Fault::SlowAnswer
            | Fault::CraftedAnswer,
        )
        | None => {}
    }
    let response = match forward(&shared.upstream, parts, body).await {
        Ok(response) => response,
        Err(err) => {
            return Ok(status(
                502,
                "InternalError",
                &format!("fault proxy: upstream failed: {err:#}"),
                None,
            ));
        }
    };
    if draw.failure == Some(Fault::ResetAfterForward) {
        // Read the answer to its end, so the request is surely done, then
        // drop it and the connection.
        let _ = response.into_body().collect().await;
        return Err(reset(&reset_handle));
    }
    Ok(response)
}

impl Shared {
    /// The first hold that catches this request and has catches left; counted.
    fn take_hold(&self, verb: Verb, path: &str, body: &[u8]) -> Option<Hold> {
        let mut held = self.held.lock().unwrap();
        let (index, hold) = self.plan.holds.iter().enumerate().find(|(i, hold)| {
            hold.matches(verb, path, body) && hold.times.is_none_or(|times| held[*i] < times)
        })?;
        held[index] += 1;
        let mut report = self.report.lock().unwrap();
        *report.requests.entry(verb).or_default() += 1;
        *report.faults.entry((hold.fault(), verb)).or_default() += 1;
        Some(hold.clone())
    }

    fn record(&self, verb: Verb, draw: &Draw) {
        let mut report = self.report.lock().unwrap();
        *report.requests.entry(verb).or_default() += 1;
        for fault in draw
            .failure
            .into_iter()
            .chain(draw.latency.map(|_| Fault::Latency))
        {
            *report.faults.entry((fault, verb)).or_default() += 1;
        }
    }
}

/// Headers that belong to one hop (RFC 9110 §7.6.1), and the client's own
/// credentials: the upstream client sends its own.
const NOT_FORWARDED: [header::HeaderName; 8] = [
    header::CONNECTION,
    header::HOST,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::AUTHORIZATION,
];

fn strip(headers: &mut HeaderMap) {
    for name in NOT_FORWARDED {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}

async fn forward(
    upstream: &kube::Client,
    mut parts: http::request::Parts,
    bytes: Bytes,
) -> Result<Response<Body>> {
    strip(&mut parts.headers);
    parts.headers.remove(header::CONTENT_LENGTH);
    // The upstream client puts its own scheme and authority in front.
    parts.uri = parts
        .uri
        .path_and_query()
        .map(|pq| Uri::from(pq.clone()))
        .unwrap_or_else(|| Uri::from_static("/"));
    let response = upstream
        .send(Request::from_parts(parts, Body::from(bytes)))
        .await?;
    // The body streams through as it comes: a watch stays a watch.
    let (mut parts, body) = response.into_parts();
    strip(&mut parts.headers);
    Ok(Response::from_parts(parts, body))
}

/// A `Status` answer as the apiserver writes one, so kube reads it as an
/// API error with this code and reason.
fn status(code: u16, reason: &str, message: &str, retry_after: Option<u32>) -> Response<Body> {
    let mut body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if let Some(seconds) = retry_after {
        body["details"] = serde_json::json!({ "retryAfterSeconds": seconds });
    }
    let mut response = Response::new(Body::from(body.to_string().into_bytes()));
    *response.status_mut() = StatusCode::from_u16(code).expect("a valid status code");
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    if let Some(seconds) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(seconds));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verb(method: Method, uri: &str) -> Verb {
        Verb::of(&method, &uri.parse().unwrap())
    }

    #[test]
    fn verbs_are_read_from_method_path_and_watch_parameter() {
        let hr = "/apis/helm.toolkit.fluxcd.io/v2/namespaces/apps/helmreleases";
        assert_eq!(verb(Method::GET, hr), Verb::List);
        assert_eq!(verb(Method::GET, &format!("{hr}/web")), Verb::Get);
        assert_eq!(verb(Method::GET, &format!("{hr}/web/status")), Verb::Get);
        assert_eq!(
            verb(Method::GET, &format!("{hr}?watch=true&resourceVersion=1")),
            Verb::Watch
        );
        assert_eq!(verb(Method::GET, "/api/v1/namespaces"), Verb::List);
        assert_eq!(verb(Method::GET, "/api/v1/namespaces/apps"), Verb::Get);
        assert_eq!(
            verb(Method::GET, "/api/v1/namespaces/apps/secrets"),
            Verb::List
        );
        assert_eq!(verb(Method::GET, "/apis/apps/v1/deployments"), Verb::List);
        assert_eq!(verb(Method::GET, "/version"), Verb::Get);
        assert_eq!(verb(Method::POST, hr), Verb::Create);
        assert_eq!(verb(Method::PUT, &format!("{hr}/web")), Verb::Update);
        assert_eq!(verb(Method::PATCH, &format!("{hr}/web")), Verb::Patch);
        assert_eq!(verb(Method::DELETE, &format!("{hr}/web")), Verb::Delete);
    }

    #[test]
    fn a_conflict_is_never_drawn_for_a_read_nor_a_reset_after_forwarding_for_a_watch() {
        let plan = FaultPlan::every_verb(
            3,
            Rates {
                conflict: 0.5,
                reset_after: 0.5,
                ..Rates::default()
            },
        );
        let mut rng = SeededRng::new(3);
        for _ in 0..1_000 {
            assert_ne!(
                plan.draw(Verb::Get, &mut rng).failure,
                Some(Fault::Conflict)
            );
            assert_ne!(
                plan.draw(Verb::Watch, &mut rng).failure,
                Some(Fault::ResetAfterForward)
            );
        }
        let writes = (0..1_000)
            .filter(|_| plan.draw(Verb::Patch, &mut rng).failure == Some(Fault::Conflict))
            .count();
        assert!((400..600).contains(&writes), "{writes}");
    }

    #[test]
    fn a_verb_without_rates_gets_no_fault() {
        let plan = FaultPlan::none(1).with_verbs(&[Verb::Patch], Rates::all(0.1));
        let mut rng = SeededRng::new(1);
        for _ in 0..1_000 {
            let draw = plan.draw(Verb::Get, &mut rng);
            assert!(draw.failure.is_none() && draw.latency.is_none());
        }
    }

    #[test]
    fn a_hold_picks_requests_by_verb_path_end_and_what_their_body_lacks() {
        let hold = Hold::black_hole(Verb::Patch, "/helmreleases/web")
            .body_lacks("finalizers")
            .body_lacks("annotations");
        let path = "/apis/helm.toolkit.fluxcd.io/v2/namespaces/a/helmreleases/web";
        assert!(hold.matches(Verb::Patch, path, br#"{"metadata":{"uid":"u"}}"#));
        assert!(!hold.matches(Verb::Patch, path, br#"{"metadata":{"finalizers":[]}}"#));
        assert!(!hold.matches(Verb::Patch, path, br#"{"metadata":{"annotations":{}}}"#));
        assert!(!hold.matches(Verb::Get, path, b""));
        assert!(!hold.matches(Verb::Patch, &format!("{path}2"), b"{}"));
        assert_eq!(hold.fault(), Fault::BlackHole);
        let slow = Hold::slow_answer(Verb::Delete, "/x", Duration::from_secs(1));
        assert_eq!(slow.fault(), Fault::SlowAnswer);
        assert!(slow.matches(Verb::Delete, "/api/v1/x", b""));
    }

    #[test]
    fn the_same_seed_draws_the_same_faults() {
        let plan = FaultPlan::every_verb(9, Rates::all(0.1));
        let draws = |seed| {
            let mut rng = SeededRng::new(seed);
            (0..200)
                .map(|_| plan.draw(Verb::Patch, &mut rng).failure)
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(9), draws(9));
    }
}
