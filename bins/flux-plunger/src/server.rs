//! The HTTP endpoints: `/metrics` on the metrics address, `/healthz` and
//! `/readyz` on the health address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Whether this process works (readiness): as a candidate waiting for the
/// Lease, or as the leader once its watch has synced. Never "this process
/// leads": a standby that answered 503 would keep a Deployment of two
/// replicas from becoming available, and Flux's own controllers answer
/// readiness whether they lead or not.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set_ready(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Leading now, until the watch has synced.
    pub fn set_syncing(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A bound listener, so the caller knows the port before serving (`:0` in tests).
pub async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    use anyhow::Context;
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {what} address {addr}"))
}

/// Serves `/metrics`; `refresh` runs before each scrape to update gauges.
pub async fn serve_metrics<F>(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    refresh: F,
) -> std::io::Result<()>
where
    F: Fn(&Metrics) + Send + Sync + 'static,
{
    let refresh = Arc::new(refresh);
    let app = Router::new().route(
        "/metrics",
        get(move |State(metrics): State<Arc<Metrics>>| {
            let refresh = refresh.clone();
            async move {
                refresh(&metrics);
                (
                    [(
                        CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    metrics.encode(),
                )
            }
        }),
    );
    axum::serve(listener, app.with_state(metrics)).await
}

/// Serves `/healthz` (the process answers) and `/readyz` (the watch synced).
pub async fn serve_health(listener: TcpListener, readiness: Readiness) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(readiness): State<Readiness>| async move {
                if readiness.is_ready() {
                    (StatusCode::OK, "ok").into_response()
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "waiting for the HelmRelease watch to sync",
                    )
                        .into_response()
                }
            }),
        )
        .with_state(readiness);
    axum::serve(listener, app).await
}
