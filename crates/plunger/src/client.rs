//! The one way the binaries build a client: every request but a watch has a
//! deadline.
//!
//! kube's client sets no read timeout, so a request on a connection whose
//! peer went away without a word (a remote cluster's apiserver, one instance
//! of an HA control plane, a paused process) would never resolve: a recovery
//! would never run its undo, a drain would never reach its deadline. Here a
//! request that has not been answered, body included, within its timeout fails
//! with `TimedOut`, an error like any other. A watch keeps kube-runtime's own
//! idle timeout (the server closes it after `timeoutSeconds`, the watcher gives
//! up on a silent one a little later), since a watch is meant to stay open.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use kube::client::{Body, ClientBuilder};
use tower_layer::Layer;
use tower_service::Service;

use crate::lease::Leadership;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client for `config` whose every non-watch request ends within `timeout`.
pub fn bounded(config: kube::Config, timeout: Duration) -> kube::Result<kube::Client> {
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&RequestTimeoutLayer { timeout })
        .build())
}

/// As [`bounded`], for a writer under the leader Lease: a write is sent only
/// while `leadership` is current, and fails with [`NotLeader`] otherwise. Every
/// write goes through this one check, whichever code sends it.
pub(crate) fn bounded_writer(
    config: kube::Config,
    timeout: Duration,
    leadership: tokio::sync::watch::Receiver<Leadership>,
) -> kube::Result<kube::Client> {
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&WriteGateLayer { leadership })
        .with_layer(&RequestTimeoutLayer { timeout })
        .build())
}

/// A write that was not sent: this process's leadership (of the leader Lease)
/// has lapsed or is lost.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "not sent: {method} {path} needs the leader Lease, and this process's leadership has lapsed"
)]
struct NotLeader {
    method: http::Method,
    pub(crate) path: String,
}

/// True when `err` is a write held back by [`bounded_writer`].
pub(crate) fn is_not_leader(err: &kube::Error) -> bool {
    caused_by::<NotLeader>(err)
}

/// A request that got no complete answer in time.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no answer from the apiserver within {}s to {method} {path}", timeout.as_secs_f64())]
pub(crate) struct TimedOut {
    pub(crate) timeout: Duration,
    method: http::Method,
    pub(crate) path: String,
}

/// True when `err` is a request that ran out of time (`TimedOut`).
pub fn is_timeout(err: &kube::Error) -> bool {
    caused_by::<TimedOut>(err)
}

fn caused_by<E: std::error::Error + 'static>(err: &kube::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(err) = source {
        if err.is::<E>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// Holds back writes while the leadership is not current.
#[derive(Debug, Clone)]
struct WriteGateLayer {
    pub(crate) leadership: tokio::sync::watch::Receiver<Leadership>,
}

impl<S> Layer<S> for WriteGateLayer {
    type Service = WriteGate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WriteGate {
            inner,
            leadership: self.leadership.clone(),
        }
    }
}

#[derive(Debug, Clone)]
struct WriteGate<S> {
    inner: S,
    leadership: tokio::sync::watch::Receiver<Leadership>,
}

impl<S> Service<Request<Body>> for WriteGate<S>
where
    S: Service<Request<Body>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let reads = [http::Method::GET, http::Method::HEAD, http::Method::OPTIONS];
        if !reads.contains(request.method()) && !self.leadership.borrow().is_current() {
            let refused = NotLeader {
                method: request.method().clone(),
                path: request.uri().path().to_owned(),
            };
            return Box::pin(async move { Err(refused.into()) });
        }
        let response = self.inner.call(request);
        Box::pin(async move { response.await.map_err(Into::into) })
    }
}

/// Bounds every request but a watch: the answer's head and its whole body.
#[derive(Debug, Clone, Copy)]
struct RequestTimeoutLayer {
    pub(crate) timeout: Duration,
}

impl<S> Layer<S> for RequestTimeoutLayer {
    type Service = RequestTimeout<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestTimeout {
            inner,
            timeout: self.timeout,
        }
    }
}

#[derive(Debug, Clone)]
struct RequestTimeout<S> {
    inner: S,
    timeout: Duration,
}

type ResponseFuture<B> =
    Pin<Box<dyn Future<Output = Result<Response<BoundedBody<B>>, BoxError>> + Send>>;

impl<S, B> Service<Request<Body>> for RequestTimeout<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Response = Response<BoundedBody<B>>;
    type Error = BoxError;
    type Future = ResponseFuture<B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if is_watch(request.uri()) {
            let response = self.inner.call(request);
            return Box::pin(async move {
                let response = response.await.map_err(Into::into)?;
                Ok(response.map(|inner| BoundedBody {
                    inner,
                    deadline: None,
                }))
            });
        }
        let timed_out = TimedOut {
            timeout: self.timeout,
            method: request.method().clone(),
            path: request.uri().path().to_owned(),
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = match tokio::time::timeout_at(deadline, response).await {
                Ok(response) => response.map_err(Into::into)?,
                Err(_) => return Err(timed_out.into()),
            };
            Ok(response.map(|inner| BoundedBody {
                inner,
                deadline: Some((Box::pin(tokio::time::sleep_until(deadline)), timed_out)),
            }))
        })
    }
}

fn is_watch(uri: &http::Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

/// A response body that fails once its request's deadline has passed.
struct BoundedBody<B> {
    inner: B,
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, TimedOut)>,
}

impl<B> HttpBody for BoundedBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if let Some((sleep, timed_out)) = &mut this.deadline
            && sleep.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Some(Err(timed_out.clone().into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_watch_goes_unbounded() {
        let uri = |s: &str| s.parse::<http::Uri>().unwrap();
        assert!(is_watch(&uri(
            "/apis/helm.toolkit.fluxcd.io/v2/helmreleases?watch=true&resourceVersion=5"
        )));
        assert!(is_watch(&uri("/api/v1/pods?labelSelector=a&watch=1")));
        assert!(!is_watch(&uri("/api/v1/pods?limit=100")));
        assert!(!is_watch(&uri("/api/v1/namespaces/a/pods/watch")));
        assert!(!is_watch(&uri("/api/v1/pods?watchable=true")));
    }

    #[test]
    fn a_timeout_is_recognised_through_kube_s_error() {
        let timed_out = TimedOut {
            timeout: Duration::from_secs(10),
            method: http::Method::DELETE,
            path: "/api/v1/namespaces/a/secrets/s".into(),
        };
        let err = kube::Error::Service(Box::new(timed_out));
        assert!(is_timeout(&err));
        assert_eq!(
            err.source_text(),
            "no answer from the apiserver within 10s to DELETE /api/v1/namespaces/a/secrets/s"
        );
        assert!(!is_timeout(&kube::Error::LinesCodecMaxLineLengthExceeded));
    }

    /// Answers with `head` after `delay` (never, for `None`); its body sends
    /// one chunk and then nothing more.
    #[derive(Clone)]
    struct Upstream {
        delay: Option<Duration>,
    }

    struct Stalled {
        sent: bool,
    }

    impl HttpBody for Stalled {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            if self.sent {
                return Poll::Pending;
            }
            self.sent = true;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"{\"kind\":")))))
        }
    }

    impl Service<Request<Body>> for Upstream {
        type Response = Response<Stalled>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<Response<Stalled>, BoxError>> + Send>>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _request: Request<Body>) -> Self::Future {
            let delay = self.delay;
            Box::pin(async move {
                match delay {
                    Some(delay) => tokio::time::sleep(delay).await,
                    None => std::future::pending().await,
                }
                Ok(Response::new(Stalled { sent: false }))
            })
        }
    }

    fn client(delay: Option<Duration>, timeout: Duration) -> kube::Client {
        let service = RequestTimeoutLayer { timeout }.layer(Upstream { delay });
        kube::Client::new(service, "default")
    }

    fn get(uri: &str) -> Request<Vec<u8>> {
        Request::get(uri).body(Vec::new()).unwrap()
    }

    #[tokio::test]
    async fn a_request_never_answered_fails_at_its_timeout() {
        let client = client(None, Duration::from_millis(200));
        let started = std::time::Instant::now();
        let err = client
            .request_text(get("/api/v1/namespaces/a/secrets/s"))
            .await
            .unwrap_err();
        assert!(is_timeout(&err), "{err:?}");
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn an_answer_whose_body_stalls_fails_at_the_same_deadline() {
        let client = client(Some(Duration::from_millis(100)), Duration::from_millis(300));
        let started = std::time::Instant::now();
        let err = client
            .request_text(get("/api/v1/namespaces/a/secrets"))
            .await
            .unwrap_err();
        assert!(is_timeout(&err), "{err:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn a_watch_is_left_to_its_own_idle_timeout() {
        let client = client(None, Duration::from_millis(100));
        let watch = client.request_text(get("/api/v1/pods?watch=true&resourceVersion=1"));
        assert!(
            tokio::time::timeout(Duration::from_millis(600), watch)
                .await
                .is_err(),
            "the watch was cut by the request timeout"
        );
    }

    #[tokio::test]
    async fn a_write_is_held_back_while_the_leadership_is_not_current_and_a_read_never_is() {
        let (leadership, rx) =
            tokio::sync::watch::channel(Leadership::Until(std::time::Instant::now()));
        let service = WriteGateLayer { leadership: rx }.layer(Upstream {
            delay: Some(Duration::ZERO),
        });
        let client = kube::Client::new(service, "default");
        let request = |method: http::Method| {
            Request::builder()
                .method(method)
                .uri("/apis/helm.toolkit.fluxcd.io/v2/namespaces/a/helmreleases/web")
                .body(Body::from(b"{}".to_vec()))
                .unwrap()
        };

        let err = client.send(request(http::Method::PATCH)).await.unwrap_err();
        assert!(is_not_leader(&err), "{err:?}");
        assert!(
            client.send(request(http::Method::GET)).await.is_ok(),
            "a read is always sent"
        );
        leadership
            .send(Leadership::Until(
                std::time::Instant::now() + Duration::from_secs(60),
            ))
            .unwrap();
        assert!(client.send(request(http::Method::PATCH)).await.is_ok());
        assert!(client.send(request(http::Method::DELETE)).await.is_ok());
        leadership.send(Leadership::Lost).unwrap();
        let err = client
            .send(request(http::Method::DELETE))
            .await
            .unwrap_err();
        assert!(is_not_leader(&err), "{err:?}");
    }

    trait SourceText {
        fn source_text(&self) -> String;
    }

    impl SourceText for kube::Error {
        fn source_text(&self) -> String {
            std::error::Error::source(self)
                .map(ToString::to_string)
                .unwrap_or_default()
        }
    }
}
