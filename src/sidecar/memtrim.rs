//! Giving back the memory that only start-up used: the pages of code and read-only data that
//! the process mapped while it parsed its flags, read its kubeconfig, set up TLS and made its
//! first requests, and will not touch again.
//!
//! A sidecar runs in every campaigning pod, so its resident set is paid once per pod, and most
//! of it is the binary's own code (file pages, shared with other sidecars on the node but
//! counted in each one's RSS). Start-up runs code spread over the whole binary, and the kernel
//! maps each faulted page's neighbours too (fault-around), so by the time the sidecar settles
//! most of its text is resident although its steady state (renewing, serving the token) runs a
//! small part of it. [`trim_startup_pages`] drops this process's mappings of those pages with
//! `madvise(MADV_DONTNEED)`; whatever the process runs afterwards faults back in from the page
//! cache (no disk read: the file stays cached), so the resident set settles at what the
//! steady state uses.
//!
//! Only mappings where dropping cannot lose data are touched: file-backed, not writable, and
//! holding no anonymous (copied-on-write) pages, such as relocated read-only data. For those
//! the kernel refills a dropped page from the file, which has the same bytes.

use std::ptr::NonNull;

/// A mapping whose pages may be dropped: `start..end` (addresses) and its resident size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Region {
    pub start: usize,
    pub end: usize,
    pub rss_kib: u64,
}

/// What one trim gave back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Trimmed {
    /// Mappings dropped.
    pub regions: usize,
    /// Their resident kibibytes before the drop.
    pub kib: u64,
    /// Mappings the kernel refused to drop (for example locked ones); they stay resident.
    pub failed: usize,
}

#[derive(Debug, thiserror::Error)]
pub(super) enum Error {
    #[error("reading /proc/self/smaps: {0}")]
    Smaps(#[from] std::io::Error),
}

impl Error {
    pub(super) fn metric_label(&self) -> &'static str {
        match self {
            Error::Smaps(_) => "smaps",
        }
    }
}

/// One mapping as smaps describes it, while it is being read.
#[derive(Default)]
struct Entry {
    start: usize,
    end: usize,
    droppable_kind: bool,
    rss_kib: u64,
    anonymous_kib: Option<u64>,
}

impl Entry {
    /// Parses a mapping's header line (`start-end perms offset dev inode [path]`); None for
    /// any other line.
    fn header(line: &str) -> Option<Entry> {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        let perms = fields.next()?;
        let (_offset, _dev, inode) = (fields.next()?, fields.next()?, fields.next()?);
        let path = fields.next().unwrap_or("");
        let perms = perms.as_bytes();
        let droppable_kind = perms.len() == 4
            && perms[0] == b'r'
            && perms[1] != b'w'
            && perms[3] == b'p'
            && inode != "0"
            && path.starts_with('/');
        Some(Entry {
            start,
            end,
            droppable_kind,
            ..Entry::default()
        })
    }

    fn field(&mut self, line: &str) {
        let kib = |rest: &str| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        };
        if let Some(rest) = line.strip_prefix("Rss:") {
            self.rss_kib = kib(rest).unwrap_or(0);
        } else if let Some(rest) = line.strip_prefix("Anonymous:") {
            self.anonymous_kib = kib(rest);
        }
    }

    /// Droppable: a private, read-only file mapping with resident pages and no anonymous
    /// ones (a mapping whose Anonymous line is missing or unreadable is kept).
    fn region(self) -> Option<Region> {
        (self.droppable_kind
            && self.rss_kib > 0
            && self.anonymous_kib == Some(0)
            && self.end > self.start)
            .then_some(Region {
                start: self.start,
                end: self.end,
                rss_kib: self.rss_kib,
            })
    }
}

/// The mappings in `smaps` (the text of /proc/PID/smaps) whose resident pages can be dropped
/// without losing data.
pub(super) fn droppable(smaps: &str) -> Vec<Region> {
    let mut out = Vec::new();
    let mut current: Option<Entry> = None;
    for line in smaps.lines() {
        if let Some(next) = Entry::header(line) {
            out.extend(current.replace(next).and_then(Entry::region));
        } else if let Some(e) = current.as_mut() {
            e.field(line);
        }
    }
    out.extend(current.and_then(Entry::region));
    out
}

/// Drops this process's resident pages of its droppable mappings (see the module's doc).
/// Linux only; elsewhere /proc/self/smaps is missing and this returns the error.
pub(super) fn trim_startup_pages() -> Result<Trimmed, Error> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut trimmed = Trimmed::default();
    for r in droppable(&smaps) {
        if drop_pages(&r) {
            trimmed.regions += 1;
            trimmed.kib += r.rss_kib;
        } else {
            trimmed.failed += 1;
        }
    }
    Ok(trimmed)
}

fn drop_pages(r: &Region) -> bool {
    let Some(addr) = NonNull::new(r.start as *mut std::ffi::c_void) else {
        return false;
    };
    // SAFETY: the range is one whole mapping of this process, taken from smaps just before:
    // private, not writable, file-backed, with no anonymous page. MADV_DONTNEED only unmaps
    // its pages; the next access refills each from the file, with the same bytes, so no
    // reference into the range sees a change. A mapping that went away or changed since the
    // read makes the call fail (or drops pages of an equally read-only file mapping), which
    // is reported, not acted on.
    unsafe {
        nix::sys::mman::madvise(
            addr,
            r.end - r.start,
            nix::sys::mman::MmapAdvise::MADV_DONTNEED,
        )
    }
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(header: &str, rss: u64, anonymous: Option<u64>) -> String {
        let mut s =
            format!("{header}\nSize:               1024 kB\nRss:                {rss} kB\n");
        if let Some(a) = anonymous {
            s.push_str(&format!("Anonymous:          {a} kB\n"));
        }
        s.push_str("VmFlags: rd ex mr mw me\n");
        s
    }

    #[test]
    fn only_private_read_only_file_mappings_without_anonymous_pages() {
        let table: &[(&str, u64, Option<u64>, bool)] = &[
            ("55d0a0000000-55d0a0400000 r-xp 00001000 fd:01 1234 /usr/local/bin/fencedlease", 900, Some(0), true),
            ("55d0a0400000-55d0a0500000 r--p 00401000 fd:01 1234 /usr/local/bin/fencedlease", 200, Some(0), true),
            // relocated read-only data (RELRO): copied-on-write pages would be lost
            ("55d0a0500000-55d0a0520000 r--p 00501000 fd:01 1234 /usr/local/bin/fencedlease", 128, Some(120), false),
            ("55d0a0520000-55d0a0530000 rw-p 00521000 fd:01 1234 /usr/local/bin/fencedlease", 64, Some(64), false),
            ("7f0000000000-7f0000100000 r-xp 00000000 fd:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6", 700, Some(0), true),
            ("7f0000100000-7f0000101000 ---p 00100000 fd:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6", 0, Some(0), false),
            ("7f0000200000-7f0000300000 rw-p 00000000 00:00 0 ", 500, Some(500), false),
            ("7f0000300000-7f0000400000 r--s 00000000 00:05 77 /dev/shm/x", 100, Some(0), false),
            ("7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0 [vdso]", 8, Some(0), false),
            ("7f0000400000-7f0000401000 r-xp 00000000 fd:01 5 /usr/lib/ld.so", 0, Some(0), false),
            // no Anonymous line: not known to be safe
            ("7f0000500000-7f0000600000 r--p 00000000 fd:01 6 /usr/lib/libz.so", 40, None, false),
        ];
        for (header, rss, anon, want) in table {
            let got = droppable(&mapping(header, *rss, *anon));
            assert_eq!(!got.is_empty(), *want, "{header}");
            if *want {
                assert_eq!(got[0].rss_kib, *rss);
                assert!(got[0].end > got[0].start);
            }
        }
    }

    #[test]
    fn reads_every_mapping_of_a_whole_file() {
        let text: String = [
            mapping("1000-2000 r-xp 00000000 fd:01 1 /bin/a", 4, Some(0)),
            mapping("2000-3000 rw-p 00000000 fd:01 1 /bin/a", 4, Some(4)),
            mapping("3000-5000 r--p 00000000 fd:01 1 /bin/a", 8, Some(0)),
        ]
        .concat();
        let got = droppable(&text);
        assert_eq!(
            got,
            vec![
                Region {
                    start: 0x1000,
                    end: 0x2000,
                    rss_kib: 4
                },
                Region {
                    start: 0x3000,
                    end: 0x5000,
                    rss_kib: 8
                },
            ]
        );
    }

    #[test]
    fn garbage_yields_nothing() {
        for text in [
            "",
            "\n\n",
            "zz-yy r-xp",
            "1000-2000",
            "Rss: 5 kB\nAnonymous: 0 kB",
        ] {
            assert!(droppable(text).is_empty(), "{text:?}");
        }
    }

    /// This test process keeps running correctly after dropping its own code's pages.
    #[test]
    fn the_process_runs_on_after_a_trim() {
        let t = trim_startup_pages().unwrap();
        assert!(t.regions > 0, "{t:?}");
        let again = droppable(&std::fs::read_to_string("/proc/self/smaps").unwrap());
        assert!(!again.is_empty());
        assert_eq!(format!("{}", 6 * 7), "42");
    }
}
