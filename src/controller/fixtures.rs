//! An in-process fake API server for reconcile sequences, beside the real-server tests (which
//! stay: tests/controller.rs, tests/holder_death.rs and others). A [`Script`] is the list of
//! requests one reconcile must make, in order (a run of steps marked [`Step::in_any_order`] in
//! any order), each with the answer to give; [`Script::client`]
//! is a `kube::Client` that serves it. A request out of order, or one the script does not have,
//! is answered 500 and recorded, and [`Script::finish`] fails the test naming it, as it does
//! for expected requests that never came.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use http_body_util::BodyExt;
use hyper::{header, Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::Client;
use serde_json::Value;

/// Checks a request's JSON body; says what is wrong.
type BodyCheck = Box<dyn Fn(&Value) -> Result<(), String> + Send>;

/// One expected request and its answer.
pub(super) struct Step {
    method: Method,
    /// The request's path, query left out.
    path: String,
    check: BodyCheck,
    status: u16,
    answer: Value,
    /// May come in any order among the steps next to it that may too (requests made
    /// concurrently); the first such step that matches the request answers it.
    loose: bool,
}

impl Step {
    pub(super) fn new(method: Method, path: &str, status: u16, answer: Value) -> Step {
        Step {
            method,
            path: path.to_string(),
            check: Box::new(|_| Ok(())),
            status,
            answer,
            loose: false,
        }
    }

    /// Lets this step come in any order among its neighbours that allow it too. A request is
    /// matched by method and path to the first such step of the run at the script's head (so
    /// steps of one path keep their order, and the body check tells them apart); two runs next
    /// to each other are one run. Nothing matching: the run's first step is taken and the
    /// request is recorded as wrong.
    pub(super) fn in_any_order(mut self) -> Step {
        self.loose = true;
        self
    }

    /// Also checks the request's body.
    pub(super) fn body(
        mut self,
        check: impl Fn(&Value) -> Result<(), String> + Send + 'static,
    ) -> Step {
        self.check = Box::new(check);
        self
    }
}

#[derive(Default)]
struct State {
    steps: VecDeque<Step>,
    /// What went wrong, one line per request.
    wrong: Vec<String>,
    /// Every request seen: method and path.
    seen: Vec<String>,
}

/// The requests a reconcile must make, in order.
#[derive(Clone)]
pub(super) struct Script(Arc<Mutex<State>>);

impl Script {
    pub(super) fn new(steps: Vec<Step>) -> Script {
        Script(Arc::new(Mutex::new(State {
            steps: steps.into(),
            ..State::default()
        })))
    }

    /// A client whose every request this script answers.
    pub(super) fn client(&self) -> Client {
        let script = self.clone();
        let service = tower::service_fn(move |req: Request<Body>| {
            let script = script.clone();
            async move {
                let (status, body) = script.answer(req).await;
                let bytes = serde_json::to_vec(&body).unwrap_or_default();
                let mut resp = Response::new(Body::from(bytes));
                *resp.status_mut() =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("application/json"),
                );
                Ok::<_, std::convert::Infallible>(resp)
            }
        });
        Client::new(service, "default")
    }

    async fn answer(&self, req: Request<Body>) -> (u16, Value) {
        let (parts, body) = req.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let what = format!("{} {}", parts.method, parts.uri.path());
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        state.seen.push(what.clone());
        let at = state
            .steps
            .iter()
            .take_while(|s| s.loose)
            .position(|s| s.method == parts.method && s.path == parts.uri.path())
            .unwrap_or(0);
        let Some(step) = state.steps.remove(at) else {
            state
                .wrong
                .push(format!("{what}: not in the script (it had ended)"));
            return (500, Value::Null);
        };
        if step.method != parts.method || step.path != parts.uri.path() {
            state
                .wrong
                .push(format!("{what}: expected {} {}", step.method, step.path));
            return (500, Value::Null);
        }
        if let Err(e) = (step.check)(&json) {
            state.wrong.push(format!("{what}: {e}: {json}"));
        }
        (step.status, step.answer)
    }

    /// Fails unless every request came as scripted and the script was played to its end.
    pub(super) fn finish(&self) {
        let state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let left: Vec<String> = state
            .steps
            .iter()
            .map(|s| format!("{} {}", s.method, s.path))
            .collect();
        assert!(
            state.wrong.is_empty() && left.is_empty(),
            "requests seen: {:#?}\nwrong: {:#?}\nexpected but not made: {left:#?}",
            state.seen,
            state.wrong
        );
    }
}
