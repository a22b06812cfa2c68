//! The tenant as an attacker of flux-plunger's memory, through what its Helm
//! storage answers: Secrets in its own namespace carrying megabytes of
//! labels, and a remote cluster whose kubeconfig names a server of its own
//! that answers with more than any apiserver would. flux-plunger runs with a
//! memory limit and acts for every tenant: what one tenant's storage answers
//! must cost a bounded amount to read, however it is shaped.
//!
//! Each test measures this process's peak resident memory over one
//! reconcile (`testkit::peak_memory`), so they take turns, and live in a
//! test binary of their own.

use anyhow::Result;
use bytes::Bytes;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use plunger::reconcile::Outcome;
use serde_json::json;
use testkit::{FaultPlan, FaultProxy, Hold, Verb, World, peak_memory};

/// The most one reconcile may add to this process's peak memory here: an
/// answer is read to at most 32 MiB, and what is decoded of it is small.
const MAX_GROWTH_BYTES: u64 = 96 * 1024 * 1024;

/// A stuck release whose kubeconfig Secret names `proxy` (in front of this
/// control plane, as the admin) as its cluster, with a real stuck storage
/// there: what the proxy does not answer itself is the apiserver's.
async fn stuck_in_a_cluster_behind(w: &World, proxy: &FaultProxy) -> Result<()> {
    w.ns.create_storage_secret("web", 1, "superseded").await?;
    w.ns.create_storage_secret("web", 2, "uninstalling").await?;
    w.ns.create_remote_release("web", &proxy.kubeconfig_yaml(&w.ns.name))
        .await?;
    w.hc.handle("web").await?;
    w.ns.mark_stuck("web").await?;
    Ok(())
}

/// `head`, then `item` repeated to about `bytes`, then `tail`: a JSON
/// answer built once, which the proxy hands out without copying.
fn repeated(head: &str, item: &str, tail: &str, bytes: usize) -> Bytes {
    let mut body = String::with_capacity(bytes + head.len() + tail.len());
    body.push_str(head);
    body.push_str(item.trim_end_matches(','));
    while body.len() < bytes {
        body.push(',');
        body.push_str(item.trim_end_matches(','));
    }
    body.push_str(tail);
    Bytes::from(body)
}

/// A remote cluster's server answers the storage listing with `code` and
/// `body`: the reconcile fails, nothing is written, and reading the answer
/// costs less than [`MAX_GROWTH_BYTES`]. The error, as the reconcile reports
/// it, is returned.
async fn answered_by_a_hostile_server(prefix: &str, code: u16, body: Bytes) -> Result<String> {
    let _turn = peak_memory::turn().await;
    let w = World::create(prefix).await?;
    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(0).holding(Hold::answering(
        Verb::List,
        "/secrets",
        code,
        body,
    )))
    .await?;
    stuck_in_a_cluster_behind(&w, &proxy).await?;
    let before = w.view("web").await?;

    let reconciler = w.reconciler();
    let (reconciled, grown) = peak_memory::growth(reconciler.reconcile(&w.ns.name, "web")).await?;

    let err = reconciled.expect_err("the storage cannot be read from this answer");
    assert!(
        grown < MAX_GROWTH_BYTES,
        "reading the answer raised the peak memory by {} MiB",
        grown / (1024 * 1024)
    );
    let after = w.view("web").await?;
    assert_eq!(
        after.resource_version, before.resource_version,
        "nothing written"
    );
    assert!(
        w.ns.secret_names()
            .await?
            .contains(&"sh.helm.release.v1.web.v2".to_owned()),
        "nothing deleted"
    );
    let said = err.to_string();
    assert!(said.len() < 4096, "an error of {} bytes", said.len());
    Ok(said)
}

#[tokio::test]
async fn a_remote_answer_larger_than_any_honest_one_is_refused_before_it_is_decoded() -> Result<()>
{
    let body = repeated(
        r#"{"kind":"PartialObjectMetadataList","apiVersion":"meta.k8s.io/v1","metadata":{},"items":["#,
        r#"{"metadata":{}}"#,
        "]}",
        40 * 1024 * 1024,
    );
    let said = answered_by_a_hostile_server("hostile-large", 200, body).await?;
    assert!(said.contains("larger than"), "{said}");
    Ok(())
}

#[tokio::test]
async fn a_remote_page_of_more_secrets_than_asked_for_is_refused_at_the_first_extra_one()
-> Result<()> {
    // Each `{}` would be a whole Secret's metadata: millions of them in an
    // answer well under the size bound.
    let body = repeated(
        r#"{"kind":"PartialObjectMetadataList","apiVersion":"meta.k8s.io/v1","metadata":{},"items":["#,
        "{}",
        "]}",
        16 * 1024 * 1024,
    );
    let said = answered_by_a_hostile_server("hostile-many", 200, body).await?;
    assert!(said.contains("more than 10 items"), "{said}");
    Ok(())
}

#[tokio::test]
async fn a_remote_refusal_with_endless_details_is_read_as_its_code_and_the_start_of_its_message()
-> Result<()> {
    let message = "no ".repeat(100_000);
    let body = repeated(
        &format!(
            r#"{{"kind":"Status","apiVersion":"v1","status":"Failure","code":403,"reason":"Forbidden","message":"{message}","details":{{"causes":["#
        ),
        "{}",
        "]}}",
        16 * 1024 * 1024,
    );
    let said = answered_by_a_hostile_server("hostile-refusal", 403, body).await?;
    assert!(said.contains("403") && said.contains("Forbidden"), "{said}");
    Ok(())
}

#[tokio::test]
async fn storage_secrets_carrying_megabytes_of_labels_cost_only_the_labels_of_helm() -> Result<()> {
    let _turn = peak_memory::turn().await;
    let w = World::create("hostile-labels").await?;
    // Labels have no limit in number, only the object's size does: about a
    // megabyte each, sixty Secrets a tenant may write in its own namespace,
    // each a well-formed revision of the release.
    let junk: serde_json::Map<String, serde_json::Value> = (0..8000)
        .map(|i| (format!("junk.example.com/k{i:07}"), json!("v".repeat(63))))
        .collect();
    for revision in 1..=60u64 {
        let name = format!("sh.helm.release.v1.web.v{revision}");
        let mut labels = junk.clone();
        for (key, value) in [
            ("owner", "helm".to_owned()),
            ("name", "web".to_owned()),
            ("version", revision.to_string()),
            ("status", "superseded".to_owned()),
        ] {
            labels.insert(key.into(), json!(value));
        }
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "type": "helm.sh/release.v1",
            "data": {"release": ""},
        }))?;
        w.ns.secrets()
            .create(&PostParams::default(), &secret)
            .await?;
    }
    w.installed("web").await?;
    w.ns.create_storage_secret("web", 61, "uninstalling")
        .await?;
    w.ns.mark_stuck("web").await?;

    let reconciler = w.reconciler();
    let (outcome, grown) = peak_memory::growth(reconciler.reconcile(&w.ns.name, "web")).await?;

    assert_eq!(outcome?, Outcome::Recovered { revision: 61 });
    assert!(
        grown < MAX_GROWTH_BYTES,
        "listing the storage raised the peak memory by {} MiB",
        grown / (1024 * 1024)
    );
    Ok(())
}
