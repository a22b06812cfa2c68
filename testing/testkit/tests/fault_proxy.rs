//! The fault proxy against the real local apiserver: what each fault does
//! to a request, and that a watch streams through a quiet proxy.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::json;
use testkit::{Fault, FaultPlan, FaultProxy, Hold, Rates, TestNamespace, Verb, control_plane};

fn configmap(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("k".to_owned(), "v".to_owned())])),
        ..Default::default()
    }
}

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    let admin = control_plane().client().await?;
    TestNamespace::create(&admin, prefix).await
}

/// A proxy that injects `rates` on `verbs` only.
async fn proxy(verbs: &[Verb], rates: Rates) -> Result<FaultProxy> {
    FaultProxy::in_front_of_control_plane(FaultPlan::none(7).with_verbs(verbs, rates)).await
}

/// Creates ConfigMap `name` in `ns` through a proxy that injects `rates` on
/// every create, and expects it to fail: the proxy (for its report), the
/// ConfigMaps through it, and the error the client saw.
async fn create_failing_through(
    ns: &TestNamespace,
    rates: Rates,
    name: &str,
) -> Result<(FaultProxy, Api<ConfigMap>, kube::Error)> {
    let proxy = proxy(&[Verb::Create], rates).await?;
    let through: Api<ConfigMap> = Api::namespaced(proxy.client()?, &ns.name);
    let err = through
        .create(&PostParams::default(), &configmap(name))
        .await
        .expect_err("the injected fault fails the create");
    Ok((proxy, through, err))
}

/// A client through the proxy without kube's retry of 429/503, to see each
/// answer as the proxy gave it.
fn no_retry_client(proxy: &FaultProxy) -> Result<kube::Client> {
    let mut config = kube::Config::new(proxy.url().parse()?);
    config.default_retry = false;
    Ok(kube::Client::try_from(config)?)
}

#[tokio::test]
async fn a_quiet_proxy_passes_every_verb_through_and_streams_a_watch() -> Result<()> {
    let ns = namespace("proxy-quiet").await?;
    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(1)).await?;
    let through: Api<ConfigMap> = Api::namespaced(proxy.client()?, &ns.name);
    let direct: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);

    let created = through
        .create(&PostParams::default(), &configmap("first"))
        .await?;
    assert_eq!(
        through.get("first").await?.metadata.uid,
        created.metadata.uid
    );
    through
        .patch(
            "first",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"k": "w"}})),
        )
        .await?;
    let version = through
        .list(&ListParams::default())
        .await?
        .metadata
        .resource_version;

    // A watch opened through the proxy sees a write made afterwards, directly:
    // the chunked body streams through as it comes.
    let mut events = through
        .watch(
            &WatchParams::default().timeout(30),
            &version.unwrap_or_default(),
        )
        .await?
        .boxed();
    direct
        .create(&PostParams::default(), &configmap("second"))
        .await?;
    let seen = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = events.try_next().await? {
            if let WatchEvent::Added(cm) = event
                && cm.metadata.name.as_deref() == Some("second")
            {
                return anyhow::Ok(true);
            }
        }
        Ok(false)
    })
    .await??;
    assert!(seen, "the watch ended without the write");

    through.delete("first", &Default::default()).await?;
    assert!(direct.get_opt("first").await?.is_none());
    let report = proxy.report();
    for verb in [
        Verb::Create,
        Verb::Get,
        Verb::Patch,
        Verb::List,
        Verb::Watch,
        Verb::Delete,
    ] {
        assert_eq!(report.requests.get(&verb), Some(&1), "{verb:?} in {report}");
    }
    assert_eq!(report.total_faults(), 0);

    // Every answer's bytes are counted as they pass. Through a proxy of its
    // own: the watch above still streams through the first one (the delete's
    // event), whose bytes would land in the count at any moment.
    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(1)).await?;
    let before = proxy.report().response_bytes;
    let answer = proxy
        .client()?
        .request_text(
            http::Request::get(format!("/api/v1/namespaces/{}/configmaps", ns.name))
                .body(Vec::new())?,
        )
        .await?;
    assert_eq!(proxy.report().response_bytes - before, answer.len() as u64);
    Ok(())
}

#[tokio::test]
async fn a_kubeconfig_for_a_process_goes_through_the_proxy() -> Result<()> {
    let ns = namespace("proxy-kubeconfig").await?;
    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(2)).await?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&proxy.kubeconfig_yaml(&ns.name))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    assert_eq!(config.default_namespace, ns.name);
    let client = kube::Client::try_from(config)?;

    Api::<ConfigMap>::default_namespaced(client)
        .create(&PostParams::default(), &configmap("via-kubeconfig"))
        .await?;

    assert!(
        ns_configmaps(&ns)
            .get_opt("via-kubeconfig")
            .await?
            .is_some()
    );
    assert_eq!(proxy.report().requests.get(&Verb::Create), Some(&1));
    Ok(())
}

#[tokio::test]
async fn an_injected_conflict_on_a_write_means_nothing_was_written() -> Result<()> {
    let ns = namespace("proxy-409").await?;
    let rates = Rates {
        conflict: 1.0,
        ..Rates::default()
    };

    let (proxy, _, err) = create_failing_through(&ns, rates, "never").await?;

    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "{err:?}"
    );
    assert!(ns_configmaps(&ns).get_opt("never").await?.is_none());
    assert_eq!(proxy.report().count(Fault::Conflict), 1);
    Ok(())
}

#[tokio::test]
async fn a_reset_before_forwarding_fails_the_request_and_writes_nothing() -> Result<()> {
    let ns = namespace("proxy-reset-before").await?;
    let rates = Rates {
        reset_before: 1.0,
        ..Rates::default()
    };

    let (proxy, _, err) = create_failing_through(&ns, rates, "never").await?;

    assert!(was_reset(&err), "a connection reset: {err:?}");
    assert!(ns_configmaps(&ns).get_opt("never").await?.is_none());
    assert_eq!(proxy.report().count(Fault::ResetBeforeForward), 1);
    Ok(())
}

#[tokio::test]
async fn a_reset_after_forwarding_loses_the_answer_but_not_the_write() -> Result<()> {
    let ns = namespace("proxy-reset-after").await?;
    let rates = Rates {
        reset_after: 1.0,
        ..Rates::default()
    };

    let (proxy, through, err) = create_failing_through(&ns, rates, "written").await?;

    assert!(was_reset(&err), "a connection reset: {err:?}");
    assert!(ns_configmaps(&ns).get_opt("written").await?.is_some());
    // The connection is gone, not the proxy: the next request goes through.
    assert!(through.get_opt("written").await?.is_some());
    assert_eq!(proxy.report().count(Fault::ResetAfterForward), 1);
    Ok(())
}

#[tokio::test]
async fn injected_5xx_and_429_answer_as_the_apiserver_would() -> Result<()> {
    let ns = namespace("proxy-status").await?;
    for (rates, code) in [
        (
            Rates {
                internal_error: 1.0,
                ..Rates::default()
            },
            500,
        ),
        (
            Rates {
                unavailable: 1.0,
                ..Rates::default()
            },
            503,
        ),
        (
            Rates {
                too_many_requests: 1.0,
                ..Rates::default()
            },
            429,
        ),
    ] {
        let proxy = proxy(&[Verb::List], rates).await?;
        let client = no_retry_client(&proxy)?;
        let path = format!("/api/v1/namespaces/{}/configmaps", ns.name);
        let response = client
            .send(http::Request::get(&path).body(kube::client::Body::from(Vec::new()))?)
            .await?;
        assert_eq!(response.status().as_u16(), code);
        if code == 429 {
            assert_eq!(response.headers()[http::header::RETRY_AFTER], "1");
        }
        let err = Api::<ConfigMap>::namespaced(client, &ns.name)
            .list(&ListParams::default())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == code),
            "{err:?}"
        );
        // Only lists were configured: a get goes through.
        let through: Api<ConfigMap> = Api::namespaced(proxy.client()?, &ns.name);
        assert!(through.get_opt("absent").await?.is_none());
        assert_eq!(proxy.report().total_faults(), 2, "{}", proxy.report());
    }
    Ok(())
}

#[tokio::test]
async fn latency_delays_a_request_without_failing_it_and_is_counted() -> Result<()> {
    let ns = namespace("proxy-latency").await?;
    let proxy = proxy(
        &Verb::ALL,
        Rates {
            latency: 1.0,
            ..Rates::default()
        },
    )
    .await?;
    let through: Api<ConfigMap> = Api::namespaced(proxy.client()?, &ns.name);
    through
        .create(&PostParams::default(), &configmap("slow"))
        .await?;
    assert!(through.get_opt("slow").await?.is_some());
    assert_eq!(proxy.report().count(Fault::Latency), 2);
    Ok(())
}

#[tokio::test]
async fn a_disabled_proxy_injects_nothing_but_still_counts() -> Result<()> {
    let ns = namespace("proxy-disabled").await?;
    let proxy = proxy(&Verb::ALL, Rates::all(0.15)).await?;
    proxy.set_enabled(false);
    let through: Api<ConfigMap> = Api::namespaced(no_retry_client(&proxy)?, &ns.name);
    for _ in 0..20 {
        through.list(&ListParams::default()).await?;
    }
    let report = proxy.report();
    assert_eq!(report.requests.get(&Verb::List), Some(&20));
    assert_eq!(report.total_faults(), 0);
    Ok(())
}

/// A client through the proxy whose requests give up after `timeout`, as
/// every client of flux-plunger's binaries does.
fn bounded_client(proxy: &FaultProxy, timeout: Duration) -> Result<kube::Client> {
    Ok(plunger::client::bounded(
        kube::Config::new(proxy.url().parse()?),
        timeout,
    )?)
}

#[tokio::test]
async fn a_black_hole_never_answers_nor_forwards_the_requests_it_holds_and_passes_the_rest()
-> Result<()> {
    let ns = namespace("proxy-black-hole").await?;
    let plan = FaultPlan::none(3).holding(Hold::black_hole(Verb::Create, "/configmaps").times(1));
    let proxy = FaultProxy::in_front_of_control_plane(plan).await?;
    let through: Api<ConfigMap> =
        Api::namespaced(bounded_client(&proxy, Duration::from_secs(2))?, &ns.name);

    let started = std::time::Instant::now();
    let err = through
        .create(&PostParams::default(), &configmap("held"))
        .await
        .expect_err("no answer");
    assert!(plunger::client::is_timeout(&err), "{err:?}");
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert!(
        ns_configmaps(&ns).get_opt("held").await?.is_none(),
        "never forwarded"
    );
    assert_eq!(proxy.report().count(Fault::BlackHole), 1);
    // Only the first create was held.
    through
        .create(&PostParams::default(), &configmap("after"))
        .await?;
    assert!(through.get_opt("held").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn a_slow_answer_is_written_at_once_and_answered_late() -> Result<()> {
    let ns = namespace("proxy-slow-answer").await?;
    let plan = FaultPlan::none(4).holding(Hold::slow_answer(
        Verb::Create,
        "/configmaps",
        Duration::from_secs(3),
    ));
    let proxy = FaultProxy::in_front_of_control_plane(plan).await?;

    // A client that gives up first: the write happened all the same.
    let impatient: Api<ConfigMap> =
        Api::namespaced(bounded_client(&proxy, Duration::from_secs(1))?, &ns.name);
    let err = impatient
        .create(&PostParams::default(), &configmap("written"))
        .await
        .expect_err("answered after the client gave up");
    assert!(plunger::client::is_timeout(&err), "{err:?}");
    assert!(ns_configmaps(&ns).get_opt("written").await?.is_some());

    // A patient one gets the answer, late.
    let patient: Api<ConfigMap> =
        Api::namespaced(bounded_client(&proxy, Duration::from_secs(30))?, &ns.name);
    let started = std::time::Instant::now();
    patient
        .create(&PostParams::default(), &configmap("late"))
        .await?;
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert_eq!(proxy.report().count(Fault::SlowAnswer), 2);
    Ok(())
}

/// Whether the client saw its connection reset (an io error of that kind
/// somewhere in the chain), not merely closed or answered.
fn was_reset(err: &kube::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset)
        {
            return true;
        }
        source = e.source();
    }
    false
}

fn ns_configmaps(ns: &TestNamespace) -> Api<ConfigMap> {
    Api::namespaced(ns.client.clone(), &ns.name)
}
