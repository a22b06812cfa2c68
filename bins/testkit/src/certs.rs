//! Certificates for the local control plane: a CA, the apiserver's serving
//! certificate for loopback, an admin client certificate in `system:masters`,
//! and the service-account signing key. Generated fresh for every run.

use std::path::{Path, PathBuf};

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// PEM files written into the control plane's directory.
pub struct Pki {
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
        ])?;
        serving_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving_params.signed_by(&serving_key, &issuer)?;

        let admin_key = KeyPair::generate()?;
        let mut admin_params = CertificateParams::new(Vec::<String>::new())?;
        admin_params
            .distinguished_name
            .push(DnType::CommonName, "flux-plunger-test-admin");
        admin_params
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_cert = admin_params.signed_by(&admin_key, &issuer)?;

        let service_account_key = KeyPair::generate()?;

        let pki = Self {
            ca_cert: dir.join("ca.crt"),
            ca_cert_pem,
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert_pem: admin_cert.pem(),
            admin_key_pem: admin_key.serialize_pem(),
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
}
