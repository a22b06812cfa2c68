//! The tenant as an attacker of the drain's and the sweep's memory, through
//! the releases it writes: a HelmRelease is at most etcd's 1.5 MiB, most of
//! it `spec.values`, and a page of a hundred of them is what the tenant made
//! it. The drain and the pre-delete sweep list every fenced release in scope
//! with a memory limit of 128Mi; the releases one tenant writes must not
//! take them past it, or every tenant's fences are left behind.
//!
//! The test measures this process's peak resident memory over one listing
//! (`testkit::peak_memory`), so it lives in a test binary of its own.

use std::collections::BTreeSet;

use anyhow::Result;
use plunger::release::api::list_in_pages;
use plunger::scope::Scope;
use serde_json::json;
use testkit::{World, peak_memory};

/// The most listing these releases may add to this process's peak memory:
/// a page's answer is read to at most 16 MiB (held once as it arrives, once
/// whole), and the values are skipped as it is decoded.
const MAX_GROWTH_BYTES: u64 = 48 * 1024 * 1024;

/// How many releases the tenant writes, and the values of each.
const RELEASES: usize = 40;
const VALUES_BYTES: usize = 1024 * 1024;

#[tokio::test]
async fn releases_of_a_megabyte_of_values_each_are_listed_in_pages_the_drain_can_hold() -> Result<()>
{
    let _turn = peak_memory::turn().await;
    let w = World::create("hostile-values").await?;
    let blob = "v".repeat(VALUES_BYTES);
    for i in 0..RELEASES {
        w.ns.create_release(&format!("web-{i:02}"), json!({"values": {"blob": blob}}))
            .await?;
    }
    drop(blob);
    let scope = Scope {
        namespaces: vec![w.ns.name.clone()],
        label_selector: None,
    };

    // Pages of 100, as the drain and the sweep ask for: all forty at once,
    // 40 MiB of answer, unless the page is asked for again shorter.
    let (listed, grown) = peak_memory::growth(list_in_pages(&w.flux_plunger, &scope, 100, |r| {
        Some(r.name)
    }))
    .await?;

    let listed = listed?;
    let names: BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(
        (listed.len(), names.len()),
        (RELEASES, RELEASES),
        "every release listed once"
    );
    assert!(
        grown < MAX_GROWTH_BYTES,
        "listing the releases raised the peak memory by {} MiB",
        grown / (1024 * 1024)
    );
    Ok(())
}
