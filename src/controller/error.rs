//! What a reconcile can fail with, each with a bounded metric label and a note short enough
//! for an Event.

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("the object has no namespace")]
    NoNamespace,
    #[error(
        "moving the fencedlease.io/role label of pod {pod}: {} (the controller needs patch on \
         pods in that namespace)",
        short(source)
    )]
    LeaderLabel {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "reading pod {pod}, whose holder looks dead, before revoking: {} (the controller needs \
         list on pods in that namespace)",
        short(source)
    )]
    HolderPod {
        pod: String,
        #[source]
        source: kube::Error,
    },
}

/// A Kubernetes error in a sentence: an API error's message, without its whole Status.
pub(super) fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => e.to_string(),
    }
}

/// The longest Event note the API server accepts (events.k8s.io/v1), in bytes.
pub(super) const MAX_EVENT_NOTE: usize = 1024;

/// `note` cut to what an Event may hold, on a character boundary.
pub(super) fn bounded_note(mut note: String) -> String {
    if note.len() > MAX_EVENT_NOTE {
        let mut end = MAX_EVENT_NOTE - '…'.len_utf8();
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push('…');
    }
    note
}

impl Error {
    pub(crate) fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Error::Kube(kube::Error::Api(_)) => "api",
            Error::Kube(_) => "client",
            Error::NoNamespace => "no_namespace",
            Error::LeaderLabel { .. } => "leader_label",
            Error::HolderPod { .. } => "holder_pod",
        }
    }
}
