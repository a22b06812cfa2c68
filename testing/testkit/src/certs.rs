//! Certificates for the local control plane: a CA, the apiserver's serving
//! certificate for loopback (and the `kubernetes` Service's address, which a
//! node's pods dial), an admin client certificate in `system:masters`, the
//! service-account signing key, client certificates for the node's
//! components and serving certificates for the test world's other servers on
//! demand ([`Pki::client_certificate`], [`Pki::serving_certificate`]).
//! Generated fresh for every run.

use std::path::{Path, PathBuf};

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// PEM files written into the control plane's directory.
pub struct Pki {
    issuer: Issuer<'static, KeyPair>,
    pub ca_cert: PathBuf,
    pub ca_cert_pem: String,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub admin_cert_pem: String,
    pub admin_key_pem: String,
    pub service_account_key: PathBuf,
    pub service_account_public_key: PathBuf,
}

impl Pki {
    pub fn generate(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;

        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "flux-plunger-test-ca");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let ca_cert_pem = ca_cert.pem();
        let issuer = Issuer::new(ca_params, ca_key);

        let serving_key = KeyPair::generate()?;
        let mut serving_params = CertificateParams::new(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "kubernetes".to_owned(),
            "kubernetes.default.svc".to_owned(),
            crate::node::network::KUBERNETES_SERVICE_IP.to_owned(),
        ])?;
        serving_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving_params.signed_by(&serving_key, &issuer)?;

        let (admin_cert_pem, admin_key_pem) =
            sign_client(&issuer, "flux-plunger-test-admin", Some("system:masters"))?;

        let service_account_key = KeyPair::generate()?;

        let pki = Self {
            issuer,
            ca_cert: dir.join("ca.crt"),
            ca_cert_pem,
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert_pem,
            admin_key_pem,
            service_account_key: dir.join("service-account.key"),
            service_account_public_key: dir.join("service-account.pub"),
        };
        std::fs::write(&pki.ca_cert, &pki.ca_cert_pem)?;
        std::fs::write(&pki.serving_cert, serving_cert.pem())?;
        std::fs::write(&pki.serving_key, serving_key.serialize_pem())?;
        std::fs::write(
            &pki.service_account_key,
            service_account_key.serialize_pem(),
        )?;
        std::fs::write(
            &pki.service_account_public_key,
            service_account_key.public_key_pem(),
        )?;
        Ok(pki)
    }

    /// A client certificate and its key (PEM) for `common_name` in
    /// `organization` (the user name and group the apiserver sees), signed by
    /// the control plane's CA.
    pub fn client_certificate(
        &self,
        common_name: &str,
        organization: Option<&str>,
    ) -> Result<(String, String)> {
        sign_client(&self.issuer, common_name, organization)
    }

    /// A serving certificate and its key (PEM) for `names` (DNS names or IP
    /// addresses), signed by the control plane's CA: a server of the test
    /// world (the OCI registry) that clients verify against
    /// [`Pki::ca_cert`], as they would a real one, with no
    /// "insecure" switch anywhere.
    pub fn serving_certificate(&self, names: &[&str]) -> Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())?;
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("server"),
        );
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

fn sign_client(
    issuer: &Issuer<'static, KeyPair>,
    common_name: &str,
    organization: Option<&str>,
) -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    if let Some(organization) = organization {
        params
            .distinguished_name
            .push(DnType::OrganizationName, organization);
    }
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}
