//! Requests whose answers are read to a bound. What a tenant writes (a
//! release of megabytes, Secrets of megabytes of labels) or a server its
//! kubeconfig names shapes what the apiserver answers; kube's own requests
//! hold an answer whole, and copy it, before decoding it. These read at
//! most a given number of bytes, decode what they read, and keep of a
//! refusal only its code, reason and the start of its message.

use std::fmt;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use kube::Client;
use kube::client::Body;
use kube::core::Status;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::untrusted::{Excerpt, Object};

/// The most of a refusal's message kept.
const MAX_REFUSAL_MESSAGE_BYTES: usize = 1024;

/// An answer longer than its bound: no honest answer is.
#[derive(Debug)]
pub(crate) struct TooLarge {
    max: usize,
}

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the answer is larger than {} bytes, more than any honest answer",
            self.max
        )
    }
}

impl std::error::Error for TooLarge {}

/// Whether `err` is an answer longer than its bound ([`TooLarge`]).
pub(crate) fn is_too_large(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Service(inner) if inner.is::<TooLarge>())
}

/// Sends `request` and decodes its answer as `T`, reading at most `max`
/// bytes of it ([`TooLarge`] past that). A refusal (4xx, 5xx) is
/// `kube::Error::Api`, as kube's own requests answer it, with its message
/// cut to [`MAX_REFUSAL_MESSAGE_BYTES`] and its details unread.
pub(crate) async fn send<T: DeserializeOwned>(
    client: &Client,
    request: http::Request<Vec<u8>>,
    max: usize,
) -> kube::Result<T> {
    let response = client.send(request.map(Body::from)).await?;
    let code = response.status();
    let answer = read_at_most(response.into_body(), max).await?;
    if code.is_client_error() || code.is_server_error() {
        return Err(kube::Error::Api(
            refusal_status(code.as_u16(), &answer).boxed(),
        ));
    }
    serde_json::from_slice(&answer).map_err(kube::Error::SerdeError)
}

/// The body, whole, if it is at most `max` bytes.
async fn read_at_most(body: Body, max: usize) -> kube::Result<Bytes> {
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => {
            Err(kube::Error::Service(Box::new(TooLarge { max })))
        }
        Err(err) => Err(match err.downcast::<kube::Error>() {
            Ok(err) => *err,
            Err(other) => kube::Error::Service(other),
        }),
    }
}

/// A refusal's Status, as far as it is read.
#[derive(Deserialize)]
struct Refusal {
    message: Option<Excerpt<MAX_REFUSAL_MESSAGE_BYTES>>,
    reason: Option<Excerpt<128>>,
}

/// The Status of a refusal answered `code`: its message and reason, when the
/// answer is one; else the start of the answer, as kube reads an answer that
/// is no Status (a proxy's page).
fn refusal_status(code: u16, answer: &[u8]) -> Status {
    match serde_json::from_slice::<Object<Refusal>>(answer) {
        Ok(Object(refusal)) => Status::failure(
            &refusal.message.map(|m| m.0).unwrap_or_default(),
            &refusal.reason.map(|r| r.0).unwrap_or_default(),
        ),
        Err(_) => {
            // One byte past the excerpt, so that it is marked as cut.
            let start = &answer[..answer.len().min(MAX_REFUSAL_MESSAGE_BYTES + 1)];
            let text = String::from_utf8_lossy(start);
            Status::failure(
                &crate::untrusted::excerpt(text.trim(), MAX_REFUSAL_MESSAGE_BYTES),
                "Failed to parse error data",
            )
        }
    }
    .with_code(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_keeps_its_code_reason_and_the_start_of_its_message() {
        let forbidden = refusal_status(
            403,
            br#"{"kind":"Status","code":403,"reason":"Forbidden","message":"secrets is forbidden","details":{"causes":[{}]}}"#,
        );
        assert_eq!(
            (
                forbidden.code,
                forbidden.reason.as_str(),
                forbidden.message.as_str()
            ),
            (403, "Forbidden", "secrets is forbidden")
        );
        let long = format!(r#"{{"message":"{}"}}"#, "no ".repeat(1000));
        let cut = refusal_status(500, long.as_bytes());
        assert_eq!(
            cut.message.len(),
            MAX_REFUSAL_MESSAGE_BYTES + '…'.len_utf8()
        );
        assert_eq!(cut.code, 500);
        let page = refusal_status(502, "<html>bad gateway</html>".repeat(1000).as_bytes());
        assert!(page.message.starts_with("<html>bad gateway</html>"));
        assert!(page.message.ends_with('…'), "marked as cut");
        assert!(page.message.len() <= MAX_REFUSAL_MESSAGE_BYTES + '…'.len_utf8());
        assert_eq!(
            (page.code, page.reason.as_str()),
            (502, "Failed to parse error data")
        );
    }

    #[tokio::test]
    async fn an_answer_is_read_to_its_bound_and_no_further() {
        let body = || Body::from(vec![b'x'; 1000]);
        assert_eq!(read_at_most(body(), 1000).await.unwrap().len(), 1000);
        let err = read_at_most(body(), 999).await.unwrap_err();
        assert!(is_too_large(&err), "{err}");
        assert_eq!(
            err.to_string(),
            "ServiceError: the answer is larger than 999 bytes, more than any honest answer"
        );
        assert!(!is_too_large(&kube::Error::Service("another".into())));
    }
}
