//! The fencing rule as a pure function: may a write that presents a token land on a protected
//! object? No I/O here: the webhook supplies the lease (from its cache or a fresh read).

use std::fmt;

/// Label on a protected object naming the FencedLease (same namespace) that guards it.
pub const LEASE_LABEL: &str = "fencedlease.io/lease";
/// Annotation carrying the writer's fencing token (the lease's `metadata.generation`).
pub const TOKEN_ANNOTATION: &str = "fencedlease.io/token";
/// Annotation carrying the lease UID the token belongs to (tokens restart on a re-created lease).
pub const LEASE_UID_ANNOTATION: &str = "fencedlease.io/lease-uid";
/// Annotation choosing the mode on a protected object: `enforce` (default) or `warn`.
pub const MODE_ANNOTATION: &str = "fencedlease.io/fencing";

/// Why a token string is not a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenError {
    Empty,
    NotANumber,
    Padded,
    Negative,
    TooLarge,
    Zero,
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenError::Empty => "it is empty",
            TokenError::NotANumber => "it is not a decimal number",
            TokenError::Padded => "it has a sign, spaces or leading zeros",
            TokenError::Negative => "it is negative",
            TokenError::TooLarge => "it is larger than a 64-bit generation can be",
            TokenError::Zero => "tokens start at 1",
        })
    }
}

/// Parses a token strictly: a canonical positive decimal that fits an int64, nothing else.
pub fn parse_token(s: &str) -> Result<i64, TokenError> {
    if s.is_empty() {
        return Err(TokenError::Empty);
    }
    if s.starts_with('-') && s.len() > 1 && s[1..].bytes().all(|b| b.is_ascii_digit()) {
        return Err(TokenError::Negative);
    }
    if s.trim() != s || s.starts_with('+') || (s.len() > 1 && s.starts_with('0')) {
        return Err(TokenError::Padded);
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TokenError::NotANumber);
    }
    let n: i64 = s.parse().map_err(|_| TokenError::TooLarge)?;
    if n == 0 {
        return Err(TokenError::Zero);
    }
    Ok(n)
}

/// What the webhook knows of the lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    pub uid: String,
    /// `metadata.generation`: the current token.
    pub generation: i64,
    pub holder: Option<String>,
}

/// Enforce (refuse bad writes) or warn (let them through with a warning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Warn,
}

impl Mode {
    /// From the mode annotation; anything but `warn` enforces (fail closed).
    pub fn from_annotation(v: Option<&str>) -> Mode {
        match v {
            Some("warn") => Mode::Warn,
            _ => Mode::Enforce,
        }
    }
}

/// A write to judge.
#[derive(Clone, Debug)]
pub struct WriteAttempt<'a> {
    pub lease_name: &'a str,
    pub namespace: &'a str,
    /// The token annotation on the new object.
    pub token: Option<&'a str>,
    /// The lease-uid annotation on the new object.
    pub lease_uid: Option<&'a str>,
    /// On update, the token and lease uid the stored object carries (the highest accepted).
    pub previous: Option<(Option<&'a str>, Option<&'a str>)>,
}

/// Why a write is refused. Each has its own message and metric label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    MissingToken,
    MissingLeaseUid,
    MalformedToken(TokenError),
    NoLease,
    LeaseFree {
        current: i64,
    },
    OtherLeaseIncarnation {
        current_uid: String,
    },
    Stale {
        presented: i64,
        current: i64,
        holder: Option<String>,
    },
    Regressed {
        presented: i64,
        stored: i64,
    },
    Future {
        presented: i64,
        current: i64,
        holder: Option<String>,
    },
}

impl Refusal {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Refusal::MissingToken | Refusal::MissingLeaseUid => "denied_missing",
            Refusal::MalformedToken(_) => "denied_malformed",
            Refusal::NoLease => "denied_no_lease",
            Refusal::LeaseFree { .. } => "denied_free",
            Refusal::OtherLeaseIncarnation { .. }
            | Refusal::Stale { .. }
            | Refusal::Regressed { .. } => "denied_stale",
            Refusal::Future { .. } => "denied_future",
        }
    }

    /// Could a lagging cache explain this refusal? Then confirm with a fresh read first.
    pub fn may_be_cache_lag(&self) -> bool {
        matches!(
            self,
            Refusal::NoLease
                | Refusal::LeaseFree { .. }
                | Refusal::OtherLeaseIncarnation { .. }
                | Refusal::Future { .. }
        )
    }

    /// The message a person reads in kubectl's error: the lease, what was presented, what is
    /// current, and what to do.
    pub fn message(&self, w: &WriteAttempt<'_>) -> String {
        let lease = format!("FencedLease {}/{}", w.namespace, w.lease_name);
        let presented = w.token.unwrap_or("none");
        match self {
            Refusal::MissingToken => format!(
                "fencedlease: this object is protected by {lease} (label {LEASE_LABEL}); the write must carry the holder's token in annotation {TOKEN_ANNOTATION} (and the lease uid in {LEASE_UID_ANNOTATION})"
            ),
            Refusal::MissingLeaseUid => format!(
                "fencedlease: the write presents token {presented} for {lease} but no {LEASE_UID_ANNOTATION} annotation; add the lease uid (FENCEDLEASE_LEASE_UID) so that a token of a deleted lease cannot pass"
            ),
            Refusal::MalformedToken(e) => format!(
                "fencedlease: annotation {TOKEN_ANNOTATION}={presented:?} is not a fencing token: {e}; use the decimal token of {lease} exactly as handed out"
            ),
            Refusal::NoLease => format!(
                "fencedlease: this object is protected by {lease}, which does not exist; create it (or fix label {LEASE_LABEL}: it names a lease in the object's own namespace)"
            ),
            Refusal::LeaseFree { current } => format!(
                "fencedlease: stale token {presented}: {lease} is free (nobody holds it; current token {current}); acquire the lease before writing"
            ),
            Refusal::OtherLeaseIncarnation { current_uid } => format!(
                "fencedlease: stale token {presented}: it belongs to an earlier {lease} (uid {}), which was deleted; the lease now has uid {current_uid}",
                w.lease_uid.unwrap_or("none")
            ),
            Refusal::Stale { presented, current, holder } => format!(
                "fencedlease: stale token {presented}: {lease} has moved on to token {current}, held by {}; this writer was replaced and must stop",
                holder.as_deref().unwrap_or("nobody")
            ),
            Refusal::Regressed { presented, stored } => format!(
                "fencedlease: stale token {presented}: this object already carries token {stored} from a later holder of {lease}; tokens on an object never go down"
            ),
            Refusal::Future { presented, current, holder } => format!(
                "fencedlease: token {presented} is ahead of {lease}, whose current token is {current} (held by {}); it was not handed out",
                holder.as_deref().unwrap_or("nobody")
            ),
        }
    }
}

/// The verdict on one write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Refuse(Refusal),
}

/// The fencing rule. `lease` is None when the lease does not exist (as far as the caller knows).
pub fn decide(w: &WriteAttempt<'_>, lease: Option<&LeaseView>) -> Verdict {
    use Refusal::*;
    let Some(raw) = w.token else {
        return Verdict::Refuse(MissingToken);
    };
    let presented = match parse_token(raw) {
        Ok(t) => t,
        Err(e) => return Verdict::Refuse(MalformedToken(e)),
    };
    let Some(uid) = w.lease_uid.filter(|u| !u.is_empty()) else {
        return Verdict::Refuse(MissingLeaseUid);
    };
    let Some(lease) = lease else {
        return Verdict::Refuse(NoLease);
    };
    if lease.uid != uid {
        return Verdict::Refuse(OtherLeaseIncarnation {
            current_uid: lease.uid.clone(),
        });
    }
    let holder = lease.holder.clone().filter(|h| !h.is_empty());
    if presented < lease.generation {
        return Verdict::Refuse(Stale {
            presented,
            current: lease.generation,
            holder,
        });
    }
    if presented > lease.generation {
        return Verdict::Refuse(Future {
            presented,
            current: lease.generation,
            holder,
        });
    }
    if holder.is_none() {
        return Verdict::Refuse(LeaseFree {
            current: lease.generation,
        });
    }
    // The backstop: never lower than what the object already carries from the same lease
    // incarnation, even if this view of the lease lags behind (the API server serializes
    // updates of one object, so this comparison is exact).
    if let Some((Some(prev_token), prev_uid)) = w.previous {
        if let Ok(stored) = parse_token(prev_token) {
            if prev_uid == Some(uid) && presented < stored {
                return Verdict::Refuse(Regressed { presented, stored });
            }
        }
    }
    Verdict::Allow
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lease(generation: i64, holder: Option<&str>) -> LeaseView {
        LeaseView {
            uid: "u1".into(),
            generation,
            holder: holder.map(str::to_string),
        }
    }
    fn attempt<'a>(token: Option<&'a str>, uid: Option<&'a str>) -> WriteAttempt<'a> {
        WriteAttempt {
            lease_name: "inventory",
            namespace: "shop",
            token,
            lease_uid: uid,
            previous: None,
        }
    }

    #[test]
    fn token_parsing_is_strict() {
        let table: &[(&str, Result<i64, TokenError>)] = &[
            ("1", Ok(1)),
            ("42", Ok(42)),
            ("9223372036854775807", Ok(i64::MAX)),
            ("", Err(TokenError::Empty)),
            ("0", Err(TokenError::Zero)),
            ("-3", Err(TokenError::Negative)),
            ("-", Err(TokenError::NotANumber)),
            ("+3", Err(TokenError::Padded)),
            ("03", Err(TokenError::Padded)),
            (" 3", Err(TokenError::Padded)),
            ("3 ", Err(TokenError::Padded)),
            ("3\n", Err(TokenError::Padded)),
            ("3.0", Err(TokenError::NotANumber)),
            ("1e3", Err(TokenError::NotANumber)),
            ("0x10", Err(TokenError::Padded)),
            ("abc", Err(TokenError::NotANumber)),
            ("٣", Err(TokenError::NotANumber)),
            ("9223372036854775808", Err(TokenError::TooLarge)),
            ("99999999999999999999999", Err(TokenError::TooLarge)),
        ];
        for (s, want) in table {
            assert_eq!(&parse_token(s), want, "{s:?}");
        }
    }

    #[test]
    fn the_rule_table() {
        let cur = lease(5, Some("b"));
        let free = lease(5, None);
        let blank = lease(5, Some(""));
        let cases: Vec<(WriteAttempt<'_>, Option<&LeaseView>, Verdict)> = vec![
            (attempt(Some("5"), Some("u1")), Some(&cur), Verdict::Allow),
            (
                attempt(None, Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::MissingToken),
            ),
            (
                attempt(Some("5"), None),
                Some(&cur),
                Verdict::Refuse(Refusal::MissingLeaseUid),
            ),
            (
                attempt(Some("5"), Some("")),
                Some(&cur),
                Verdict::Refuse(Refusal::MissingLeaseUid),
            ),
            (
                attempt(Some("x"), Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::MalformedToken(TokenError::NotANumber)),
            ),
            (
                attempt(Some("5"), Some("u1")),
                None,
                Verdict::Refuse(Refusal::NoLease),
            ),
            (
                attempt(Some("4"), Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::Stale {
                    presented: 4,
                    current: 5,
                    holder: Some("b".into()),
                }),
            ),
            (
                attempt(Some("6"), Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::Future {
                    presented: 6,
                    current: 5,
                    holder: Some("b".into()),
                }),
            ),
            (
                attempt(Some("5"), Some("u0")),
                Some(&cur),
                Verdict::Refuse(Refusal::OtherLeaseIncarnation {
                    current_uid: "u1".into(),
                }),
            ),
            (
                attempt(Some("5"), Some("u1")),
                Some(&free),
                Verdict::Refuse(Refusal::LeaseFree { current: 5 }),
            ),
            (
                attempt(Some("5"), Some("u1")),
                Some(&blank),
                Verdict::Refuse(Refusal::LeaseFree { current: 5 }),
            ),
        ];
        for (w, l, want) in cases {
            assert_eq!(decide(&w, l), want, "{w:?} {l:?}");
        }
    }

    #[test]
    fn an_object_never_accepts_a_lower_token_from_the_same_lease() {
        let mut w = attempt(Some("4"), Some("u1"));
        w.previous = Some((Some("7"), Some("u1")));
        // Even if the lease view were (wrongly) at 4, the stored 7 wins.
        assert_eq!(
            decide(&w, Some(&lease(4, Some("a")))),
            Verdict::Refuse(Refusal::Regressed {
                presented: 4,
                stored: 7
            })
        );
        // A token from a re-created lease (new uid) is judged against that lease alone.
        let mut w = attempt(Some("2"), Some("u1"));
        w.previous = Some((Some("7"), Some("u0")));
        assert_eq!(decide(&w, Some(&lease(2, Some("a")))), Verdict::Allow);
        // A malformed stored token does not block the current holder.
        let mut w = attempt(Some("5"), Some("u1"));
        w.previous = Some((Some("junk"), Some("u1")));
        assert_eq!(decide(&w, Some(&lease(5, Some("a")))), Verdict::Allow);
    }

    #[test]
    fn only_cache_explainable_refusals_are_rechecked() {
        assert!(Refusal::Future {
            presented: 2,
            current: 1,
            holder: None
        }
        .may_be_cache_lag());
        assert!(Refusal::NoLease.may_be_cache_lag());
        assert!(!Refusal::Stale {
            presented: 1,
            current: 2,
            holder: None
        }
        .may_be_cache_lag());
        assert!(!Refusal::MissingToken.may_be_cache_lag());
    }

    #[test]
    fn messages_name_the_lease_and_the_tokens() {
        let w = attempt(Some("4"), Some("u1"));
        let m = Refusal::Stale {
            presented: 4,
            current: 5,
            holder: Some("pod-b".into()),
        }
        .message(&w);
        assert!(
            m.contains("shop/inventory")
                && m.contains('4')
                && m.contains('5')
                && m.contains("pod-b"),
            "{m}"
        );
        assert_eq!(Mode::from_annotation(Some("warn")), Mode::Warn);
        assert_eq!(Mode::from_annotation(Some("WARN")), Mode::Enforce);
        assert_eq!(Mode::from_annotation(None), Mode::Enforce);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("FL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]
        #[test]
        fn parse_never_panics_and_round_trips(s in "\\PC{0,30}") {
            if let Ok(n) = parse_token(&s) {
                prop_assert_eq!(n.to_string(), s);
            }
        }

        #[test]
        fn only_the_current_token_of_a_held_lease_is_allowed(
            presented in 1i64..20, generation in 1i64..20, held in any::<bool>(),
            same_uid in any::<bool>(), stored in proptest::option::of(1i64..20),
        ) {
            let t = presented.to_string();
            let st = stored.map(|s| s.to_string());
            let w = WriteAttempt {
                lease_name: "l", namespace: "n", token: Some(&t),
                lease_uid: Some(if same_uid { "u1" } else { "u0" }),
                previous: Some((st.as_deref(), Some("u1"))),
            };
            let l = lease(generation, held.then_some("h"));
            let v = decide(&w, Some(&l));
            let want_allow = presented == generation && held && same_uid
                && stored.is_none_or(|s| presented >= s || !same_uid);
            prop_assert_eq!(v == Verdict::Allow, want_allow, "{:?}", v);
        }
    }
}
