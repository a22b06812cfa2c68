//! Starts the local control plane (etcd + kube-apiserver with the CRDs) and
//! keeps it up until Ctrl-C, printing how to reach it.
#![forbid(unsafe_code)]

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let plane = testkit::control_plane();
    println!("\nThe local control plane is up.");
    println!("  apiserver:  {}", plane.server);
    println!("  kubeconfig: {}", plane.kubeconfig_path.display());
    println!("\nTry, in another shell:");
    println!(
        "  _out/bin/kubectl --kubeconfig {} get helmreleases -A",
        plane.kubeconfig_path.display()
    );
    println!("\nCtrl-C stops it and removes its files.");
    tokio::signal::ctrl_c().await?;
    println!("stopping");
    Ok(())
}
