//! Request bodies: each within its own cap and the budget all bodies share, read within a
//! deadline; and answers that keep the budget until they are sent.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Body as HttpBody;
use kube::core::admission::AdmissionReview;
use kube::core::DynamicObject;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::debug;

use super::limits::Limits;
use super::metrics::{ReasonLabel, ServerMetrics};
use crate::webhook::admission;

/// Why a request body was not read; answered with [`BodyError::review`].
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the body is larger than {max} bytes, the most this webhook reads")]
    TooLarge { max: usize },
    #[error("the body could not be read ({0}); send it again")]
    Broken(String),
    #[error("the webhook is already buffering as many request bytes as it may ({budget}); retry shortly")]
    NoBudget { budget: usize },
    #[error("the body did not arrive within {0:?}; send it faster")]
    TooSlow(Duration),
}

impl BodyError {
    /// The refusing AdmissionReview to answer with.
    pub fn review(&self) -> AdmissionReview<DynamicObject> {
        admission::unreadable(&self.to_string())
    }

    fn label(&self) -> &'static str {
        match self {
            BodyError::TooLarge { .. } => "too_large",
            BodyError::Broken(_) => "broken",
            BodyError::NoBudget { .. } => "no_budget",
            BodyError::TooSlow(_) => "too_slow",
        }
    }
}

/// The bytes all request bodies together may buffer ([`Limits::body_budget_bytes`]), shared
/// by every request; read bodies with [`read_body_bounded`].
#[derive(Clone, Debug)]
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
    total: usize,
    max_body: usize,
    timeout: Duration,
    metrics: ServerMetrics,
}

impl BodyBudget {
    pub fn new(limits: &Limits, metrics: &ServerMetrics) -> BodyBudget {
        let total = limits.body_budget_bytes.min(Semaphore::MAX_PERMITS);
        BodyBudget {
            bytes: Arc::new(Semaphore::new(total)),
            total,
            max_body: limits.max_body_bytes,
            timeout: limits.body_timeout,
            metrics: metrics.clone(),
        }
    }

    /// Bytes of the budget not held by any request now.
    #[cfg(test)]
    pub(super) fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// Takes `bytes` of the budget, waiting until `deadline`.
    async fn take(&self, bytes: usize, deadline: Instant) -> Result<Held, BodyError> {
        let no_budget = BodyError::NoBudget { budget: self.total };
        let n = match u32::try_from(bytes) {
            Ok(n) if bytes <= self.total => n,
            _ => return Err(no_budget), // more than it could ever get
        };
        match tokio::time::timeout_at(deadline, self.bytes.clone().acquire_many_owned(n)).await {
            Ok(Ok(permit)) => {
                self.metrics.buffered.inc_by(i64::from(n));
                Ok(Held {
                    permit,
                    gauge: self.metrics.buffered.clone(),
                })
            }
            Ok(Err(_)) | Err(_) => Err(no_budget),
        }
    }
}

/// A part of the budget, given back when dropped.
#[derive(Debug)]
pub(super) struct Held {
    permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl Drop for Held {
    fn drop(&mut self) {
        let n = i64::try_from(self.permit.num_permits()).unwrap_or(i64::MAX);
        self.gauge.dec_by(n);
    }
}

/// The budget a read body holds; drop it when the judgement of the body is done, or hand it
/// to the answer ([`answer_within`]).
#[derive(Debug)]
pub struct BudgetGuard(Vec<Held>);

impl BudgetGuard {
    /// Bytes of the budget held (the body buffer's capacity, and what an answer added).
    pub(super) fn bytes(&self) -> usize {
        self.0.iter().map(|h| h.permit.num_permits()).sum()
    }
}

/// The answer to a request whose body holds `guard`: the guard grows to the answer's size
/// (taking the difference from the budget, waiting as a body would) and stays held until the
/// answer has been handed to the connection, so that answers count in the byte budget like
/// bodies. A /mutate answer can be ~25 times its request (a small pod with many containers
/// gets a patch per container). `Err` when no budget came in time: answer the refusal instead.
pub(in crate::webhook) async fn answer_within(
    answer: Vec<u8>,
    mut guard: BudgetGuard,
    budget: &BodyBudget,
) -> Result<GuardedAnswer, BodyError> {
    let more = answer.len().saturating_sub(guard.bytes());
    if more > 0 {
        let held = budget.take(more, Instant::now() + budget.timeout).await?;
        guard.0.push(held);
    }
    Ok(GuardedAnswer {
        data: Some(Bytes::from(answer)),
        _guard: guard,
    })
}

/// A response body that gives its budget back once it has been sent (or dropped).
#[derive(Debug)]
pub(in crate::webhook) struct GuardedAnswer {
    data: Option<Bytes>,
    _guard: BudgetGuard,
}

impl HttpBody for GuardedAnswer {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.data.take().map(|d| Ok(hyper::body::Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let n = self.data.as_ref().map_or(0, Bytes::len);
        hyper::body::SizeHint::with_exact(n as u64)
    }
}

/// Reads a request body whole, within [`Limits::max_body_bytes`] and
/// [`Limits::body_timeout`], having first taken from the shared budget all the body may
/// become (its Content-Length, or the cap). The guard holds that budget: keep it until the
/// judgement of the body is done. Refusals ([`BodyError::review`]) say what to do next.
pub async fn read_body_bounded<B>(
    body: B,
    budget: &BodyBudget,
) -> Result<(Bytes, BudgetGuard), BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let read = read_within(body, budget).await;
    if let Err(e) = &read {
        debug!(error = %e, "refused a request body");
        budget
            .metrics
            .bodies_refused
            .get_or_create(&ReasonLabel { reason: e.label() })
            .inc();
    }
    read
}

pub(super) async fn read_within<B>(
    body: B,
    budget: &BodyBudget,
) -> Result<(Bytes, BudgetGuard), BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let max = budget.max_body;
    if body.size_hint().lower() > max as u64 {
        return Err(BodyError::TooLarge { max });
    }
    // All the body may become (its declared length, or the cap) is taken from the budget at
    // once, before any of it is read: a request never holds part of the budget while it waits
    // for more. Taken frame by frame, requests holding part of their bodies waited on each
    // other until all their deadlines passed (32 bodies of 400 KiB on a 1 MiB budget: none
    // read). Until it has budget, the client waits on flow control (HTTP/2) or TCP (HTTP/1);
    // capacity not yet filled costs budget, not memory.
    let ceiling = body
        .size_hint()
        .exact()
        .and_then(|d| usize::try_from(d).ok())
        .map_or(max, |d| d.min(max));
    let deadline = Instant::now() + budget.timeout;
    let held = budget.take(ceiling, deadline).await?;
    let mut buf: Vec<u8> = Vec::with_capacity(ceiling);
    let mut body = std::pin::pin!(body);
    loop {
        let data = match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
            Err(_) => return Err(BodyError::TooSlow(budget.timeout)),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e.to_string())),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue, // trailers: not part of the review
            },
        };
        let need = buf.len() + data.len();
        if need > max {
            return Err(BodyError::TooLarge { max });
        }
        if need > ceiling {
            return Err(BodyError::Broken(format!(
                "it is longer than the {ceiling} bytes it declared"
            )));
        }
        buf.extend_from_slice(&data);
    }
    Ok((Bytes::from(buf), BudgetGuard(vec![held])))
}
