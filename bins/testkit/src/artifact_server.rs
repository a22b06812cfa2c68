//! A tiny HTTP server on loopback that plays source-controller's artifact
//! storage: helm-controller downloads a chart from the `url` of a source's
//! `status.artifact` and checks it against its `digest`.
//!
//! One server per test process, on a thread of its own (it goes with the
//! process). It answers `GET` for published paths with the bytes, anything
//! else with 404, and closes every connection after one response.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, Result};

/// The artifact server of this test process.
pub struct ArtifactServer {
    base_url: String,
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

static SERVER: OnceLock<ArtifactServer> = OnceLock::new();

/// The artifact server of this test process, started on first use.
pub fn artifact_server() -> &'static ArtifactServer {
    SERVER.get_or_init(|| ArtifactServer::start().expect("starting the artifact server"))
}

impl ArtifactServer {
    fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let files: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let served = files.clone();
        std::thread::Builder::new()
            .name("artifact-server".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let files = served.clone();
                    std::thread::spawn(move || {
                        let _ = serve(stream, &files);
                    });
                }
            })?;
        Ok(Self { base_url, files })
    }

    /// Serves `bytes` at `path` (e.g. `/helmchart/ns/name/demo-1.0.0.tgz`)
    /// and returns its URL.
    pub fn publish(&self, path: &str, bytes: Vec<u8>) -> String {
        let path = format!("/{}", path.trim_start_matches('/'));
        let url = format!("{}{path}", self.base_url);
        self.files.lock().unwrap().insert(path, bytes);
        url
    }
}

fn serve(stream: TcpStream, files: &Mutex<HashMap<String, Vec<u8>>>) -> Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Drain the headers; no request here has a body.
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" || header == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let body = match method {
        "GET" | "HEAD" => files.lock().unwrap().get(path).cloned(),
        _ => None,
    };
    let mut stream = stream;
    match body {
        Some(bytes) => {
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/gzip\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                bytes.len()
            )?;
            if method == "GET" {
                stream.write_all(&bytes)?;
            }
        }
        None => write!(
            stream,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )?,
    }
    stream.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn get(url: &str) -> String {
        let rest = url.trim_start_matches("http://");
        let (addr, path) = rest.split_at(rest.find('/').unwrap());
        let mut stream = TcpStream::connect(addr).unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    }

    #[test]
    fn a_published_file_is_served_and_anything_else_is_not_found() {
        let server = artifact_server();
        let url = server.publish("/a/b.txt", b"hello".to_vec());
        let response = get(&url);
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.ends_with("\r\n\r\nhello"), "{response}");
        let missing = get(&url.replace("b.txt", "c.txt"));
        assert!(
            missing.starts_with("HTTP/1.1 404 Not Found\r\n"),
            "{missing}"
        );
    }
}
