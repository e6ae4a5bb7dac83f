//! The identity a candidate campaigns under when none is given: shared by `campaign`, the
//! sidecar and the controller's own election.

/// `HOSTNAME-PID`: the host name (in a pod, the pod's name) and the process id, so that two
/// processes of one pod, or a restarted container, never share an identity.
pub(crate) fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_identity_ends_with_this_process_id() {
        let id = default_identity();
        let (host, pid) = id.rsplit_once('-').unwrap_or_default();
        assert!(!host.is_empty(), "{id}");
        assert_eq!(pid, std::process::id().to_string());
    }
}
