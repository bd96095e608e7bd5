//! Host lists: which nodes a job runs on, how many workers each may take, and where each rank goes.
//!
//! Every source ends in a `Vec<Host>`; host order is rank order.
//!
//! - `-H/--hosts`: `h1,h2` or `h1:8,h2:8` (a slot count after `:`). Items are trimmed, empty items
//!   are rejected. IPv6 addresses go in brackets so their colons are not read as a slot count:
//!   `[fe80::1]:4`, `user@[fe80::1]`. The brackets are dropped from the name, which is what ssh
//!   takes.
//! - Hostfiles, one host per line, in any of the usual forms:
//!   - Open MPI / DeepSpeed: `node1 slots=8` (`max_slots=N` is accepted and ignored);
//!   - MPICH: `node1:8`;
//!   - bare: `node1`.
//!
//!   `#` starts a comment, whole-line or trailing; blank lines are skipped.
//! - Slurm hostlist expressions (`SLURM_JOB_NODELIST`): `node[01-04,07]`, `gpu[1-2],cpu3`,
//!   `r[1-2]n[1-2]`. Zero padding follows the first number of each range. The same ranges are
//!   taken wherever hosts are given (`-H 'gpu[1-4]:8'`, a hostfile's `gpu[1-4] slots=8`); a
//!   bracket holding a ':' is an IPv6 address.
//! - Batch schedulers' node lists, each as its scheduler writes it: PBS/Torque's
//!   `$PBS_NODEFILE` and LSF's `$LSB_DJOB_HOSTFILE` (a host per line, once per slot),
//!   `LSB_MCPU_HOSTS` (`hostA 8 hostB 8`), `LSB_HOSTS` (a host per slot), SGE/UGE's
//!   `$PE_HOSTFILE` (`host slots queue processor-range`). `plan::nodes` decides which is read.
//!
//! Then, in order: DeepSpeed's `--include`/`--exclude` (`worker-0@worker-1:0,2`), `--nnodes N`
//! (the first N hosts), and [`rank_layout`], which numbers the workers contiguously per node.
//!
//! A host listed twice in `-H` or a hostfile is an error: silently merging or doubling it would
//! change the world size behind the user's back. (A scheduler's list names a host once per slot:
//! there its repeats are its slots.) Everything here is pure (no I/O, no environment) and returns
//! a usage error rather than panicking, whatever the input.

use std::collections::{HashMap, HashSet};

use nrun_base::error::{Error, Result};

/// Most slots one host may declare. Far above any real machine, and it bounds the slot lists
/// `--exclude` builds.
const MAX_SLOTS: usize = 1 << 20;
/// Most workers one job may have, so a typo in `--nproc-per-node` cannot exhaust memory.
const MAX_WORKERS: usize = 1 << 20;
/// Most hosts a `-H` list or a hostfile may name: far above any cluster one launch host drives
/// over ssh, and it bounds the memory and processes a mistyped or hostile list can cost.
pub(crate) const MAX_HOSTS: usize = 16_384;
/// Most names a Slurm hostlist may expand to.
const MAX_SLURM_NAMES: usize = 100_000;
/// Longest host name (DNS allows 253); also bounds the memory a Slurm expansion can take.
const MAX_NAME_LEN: usize = 255;
/// How many host names an error message lists before "and N more".
const LIST_SHOWN: usize = 8;

/// One node of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Host {
    /// As the user wrote it (an ssh destination: alias, name or address; may be user@host).
    pub name: String,
    /// Max workers on it, when the source says.
    pub slots: Option<usize>,
    /// Local ranks (slot indices) to use, from DeepSpeed-style `--include "host:0,2"`; None = all.
    pub only_slots: Option<Vec<usize>>,
}

impl Host {
    /// A host with nothing known about its slots.
    pub(crate) fn new(name: impl Into<String>) -> Host {
        Host {
            name: name.into(),
            slots: None,
            only_slots: None,
        }
    }
}

fn usage(message: String) -> Error {
    Error::usage(message)
}

/// Parses `-H/--hosts`: "h1,h2" or "h1:8,h2:8" (slots), surrounding whitespace ignored, empty items
/// rejected. Also accepts IPv6 in brackets "[fe80::1]:4" and hostlist ranges "gpu[01-04,07]:8"
/// (commas inside brackets belong to the range). A duplicate host is an error naming it.
pub(crate) fn parse_hosts_flag(s: &str) -> Result<Vec<Host>> {
    if s.trim().is_empty() {
        return Err(usage(
            "-H/--hosts is empty; give host names separated by commas, e.g. -H node1:8,node2:8"
                .to_string(),
        ));
    }
    let mut hosts = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, raw) in split_outside_brackets(s).into_iter().enumerate() {
        let number = i + 1;
        let item = raw.trim();
        if item.is_empty() {
            return Err(usage(format!(
                "-H/--hosts {s:?} has an empty item (number {number}); remove the extra comma"
            )));
        }
        let ctx = format!("-H/--hosts item {item:?}");
        for (name, slots) in parse_ranged_item(item, &ctx)? {
            if hosts.len() >= MAX_HOSTS {
                return Err(usage(format!(
                    "-H/--hosts names more than {MAX_HOSTS} hosts; nrun drives at most {MAX_HOSTS} \
                     nodes from one launch host"
                )));
            }
            if let Some(first) = seen.insert(name.clone(), number) {
                return Err(usage(format!(
                    "-H/--hosts names host {name:?} twice (items {first} and {number}); \
                     list each host once, with its slot count as host:N"
                )));
            }
            hosts.push(Host {
                name,
                slots,
                only_slots: None,
            });
        }
    }
    Ok(hosts)
}

/// `s` split at the commas outside brackets (`gpu[1,3],cpu1` -> `gpu[1,3]`, `cpu1`). Unbalanced
/// brackets are left for the item's own parser to name.
fn split_outside_brackets(s: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut start, mut depth) = (0, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&s[start..]);
    items
}

/// One `-H` item or hostfile host token, with hostlist ranges expanded: `gpu[1-3]:8` is gpu1,
/// gpu2 and gpu3 with 8 slots each, `alice@gpu[1-2]` is alice@gpu1 and alice@gpu2. A bracket
/// holding a ':' is an IPv6 address (`[fe80::1]:4`), as before ranges existed.
fn parse_ranged_item(item: &str, ctx: &str) -> Result<Vec<(String, Option<usize>)>> {
    let Some(open) = item.find('[') else {
        return Ok(vec![parse_item(item, ctx)?]);
    };
    let inner = &item[open + 1..];
    if inner[..inner.find(']').unwrap_or(inner.len())].contains(':') {
        return Ok(vec![parse_item(item, ctx)?]);
    }
    // The slot count follows the last ']': `r[1-2]n[1-2].ib:4`.
    let last = item.rfind(']').unwrap_or(0);
    let (expr, slots) = match item[last..].find(':') {
        Some(c) => (&item[..last + c], Some(&item[last + c + 1..])),
        None => (item, None),
    };
    if expr.contains(':') || slots.is_some_and(|s| s.contains(':')) {
        return Err(usage(format!(
            "{ctx} has more than one ':'; write a range as gpu[1-4] or gpu[1-4]:N"
        )));
    }
    let slots = match slots {
        Some(n) => Some(parse_count(n, ctx, "slot count")?),
        None => None,
    };
    let (user, range) = match expr.rsplit_once('@') {
        Some((u, r)) => (Some(u), r),
        None => (None, expr),
    };
    let names = expand_slurm_hostlist(range).map_err(|e| {
        usage(format!(
            "{ctx}: {}",
            e.message.replacen("the Slurm node list", "the range", 1)
        ))
    })?;
    if names.len() > MAX_HOSTS {
        return Err(usage(format!(
            "{ctx} expands to {} hosts, more than the {MAX_HOSTS} nodes nrun drives from one \
             launch host; split the job or check the range",
            names.len()
        )));
    }
    names
        .into_iter()
        .map(|n| {
            let name = match user {
                Some(u) => format!("{u}@{n}"),
                None => n,
            };
            check_name(&name, ctx)?;
            Ok((name, slots))
        })
        .collect()
}

/// Parses a hostfile's text. `origin` names the file in messages. Accepted per line: Open MPI /
/// DeepSpeed form `host slots=N` (also `max_slots=M`, ignored but accepted; other key=value ->
/// error naming it), MPICH form `host:N`, bare `host`; the host may be a range (`gpu[01-16]
/// slots=8`: one host per number, each with the line's slots). `#` starts a comment (whole line
/// or trailing), blank lines skipped. A duplicate host is an error naming both line numbers
/// ("line 3 and line 7").
pub(crate) fn parse_hostfile(text: &str, origin: &str) -> Result<Vec<Host>> {
    Ok(hostfile_lines(text, origin)?
        .into_iter()
        .flat_map(|(_, hosts)| hosts)
        .collect())
}

/// The hostfile `text` with only the lines of hosts for which `keep(name)` is true; comments,
/// blank lines and every kept line are copied byte for byte (format, slots, comments kept).
///
/// `name` is [`Host::name`] as [`parse_hostfile`] gives it (`[fe80::1]:4` -> `fe80::1`). Lines
/// are split as `str::lines` does and each ends with "\n" in the output (a CRLF file comes out
/// LF). A range line with some of its hosts dropped becomes one `host slots=N` line per kept
/// host. Text that `parse_hostfile` rejects gives the same error; dropping every host is not one.
pub(crate) fn filter_hostfile(
    text: &str,
    origin: &str,
    keep: &dyn Fn(&str) -> bool,
) -> Result<String> {
    let mut out = String::with_capacity(text.len() + 1);
    for (line, hosts) in hostfile_lines(text, origin)? {
        let kept: Vec<&Host> = hosts.iter().filter(|h| keep(&h.name)).collect();
        if kept.len() == hosts.len() {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        // Only a range line keeps some hosts of several; its names have no ':' to bracket.
        for h in kept {
            out.push_str(&h.name);
            if let Some(n) = h.slots {
                out.push_str(&format!(" slots={n}"));
            }
            out.push('\n');
        }
    }
    Ok(out)
}

/// Every line of a hostfile with the hosts it names (none: blank or comment only; several: a
/// range). Shared by [`parse_hostfile`] and [`filter_hostfile`] so both accept and reject
/// exactly the same text.
fn hostfile_lines<'a>(text: &'a str, origin: &str) -> Result<Vec<(&'a str, Vec<Host>)>> {
    let mut lines = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let lineno = i + 1;
        let hosts = parse_hostfile_line(raw, origin, lineno)?;
        for Host { name, .. } in &hosts {
            if seen.len() >= MAX_HOSTS {
                return Err(usage(format!(
                    "{origin}: more than {MAX_HOSTS} hosts (line {lineno} names host number {}); \
                     nrun drives at most {MAX_HOSTS} nodes from one launch host",
                    MAX_HOSTS + 1
                )));
            }
            if let Some(&first_line) = seen.get(name) {
                return Err(usage(format!(
                    "{origin}: host {name:?} is listed twice, on line {first_line} and line {lineno}; \
                     list each host once, with its slot count (a scheduler's node file, one line \
                     per slot as $PBS_NODEFILE, is read without --hostfile)"
                )));
            }
            seen.insert(name.clone(), lineno);
        }
        lines.push((raw, hosts));
    }
    if seen.is_empty() {
        return Err(usage(format!(
            "{origin} lists no hosts; write one host per line, e.g. `node1 slots=8`"
        )));
    }
    Ok(lines)
}

/// One hostfile line, without its line ending: the hosts it names (one, or a range's), none
/// when it is blank or only a comment. `lineno` counts from 1.
fn parse_hostfile_line(raw: &str, origin: &str, lineno: usize) -> Result<Vec<Host>> {
    let line = raw.split('#').next().unwrap_or_default().trim();
    let mut tokens = line.split_whitespace();
    let Some(first) = tokens.next() else {
        return Ok(Vec::new()); // blank or comment-only
    };
    let ctx = format!("{origin} line {lineno}");
    if first.contains('=') {
        return Err(usage(format!(
            "{ctx}: {first:?} is a key=value, but a line starts with the host name; \
             write e.g. node1 slots=8"
        )));
    }
    let names = parse_ranged_item(first, &ctx)?;
    let mut slots = names.first().and_then(|n| n.1);
    let colon_slots = slots.is_some();
    let mut seen_slots_key = false;
    let mut seen_max_slots = false;
    for tok in tokens {
        let Some((key, value)) = tok.split_once('=') else {
            return Err(usage(format!(
                "{ctx}: unexpected {tok:?} after the host name; write `host slots=N` \
                 (no spaces around '='), `host:N` or just `host`"
            )));
        };
        match key {
            "slots" => {
                if colon_slots {
                    return Err(usage(format!(
                        "{ctx}: the slot count is given twice, as host:N and as slots=; keep one"
                    )));
                }
                if seen_slots_key {
                    return Err(usage(format!("{ctx}: slots= is given twice; keep one")));
                }
                seen_slots_key = true;
                slots = Some(parse_count(value, &ctx, "slots=")?);
            }
            "max_slots" => {
                if seen_max_slots {
                    return Err(usage(format!("{ctx}: max_slots= is given twice; keep one")));
                }
                seen_max_slots = true;
                // Accepted so Open MPI hostfiles work unchanged; nrun never oversubscribes,
                // so only slots= matters. Still checked, so a typo does not pass silently.
                parse_count(value, &ctx, "max_slots=")?;
            }
            _ => {
                return Err(usage(format!(
                    "{ctx}: unknown key {key:?} in {tok:?}; nrun understands slots=N \
                     (and accepts max_slots=N), remove the rest"
                )));
            }
        }
    }
    Ok(names
        .into_iter()
        .map(|(name, _)| Host {
            name,
            slots,
            only_slots: None,
        })
        .collect())
}

/// Splits an item into its host name and what follows a ':' (a slot count or slot list),
/// handling IPv6 addresses in brackets (`[fe80::1]:4`, `user@[fe80::1]`).
fn split_host_suffix<'a>(item: &'a str, ctx: &str) -> Result<(String, Option<&'a str>)> {
    let Some(open) = item.find('[') else {
        return match item.split_once(':') {
            None => Ok((item.to_string(), None)),
            Some((_, rest)) if rest.contains(':') => Err(usage(format!(
                "{ctx} has more than one ':'; write an IPv6 address in brackets, as in [fe80::1]:4"
            ))),
            Some((name, rest)) => Ok((name.to_string(), Some(rest))),
        };
    };
    let prefix = &item[..open];
    if !(prefix.is_empty() || prefix.ends_with('@')) {
        return Err(usage(format!(
            "{ctx}: brackets hold an IPv6 address, as in [fe80::1]:4 or user@[fe80::1], or a \
             range of numbers, as in gpu[1-4]"
        )));
    }
    let after_open = &item[open + 1..];
    let Some(close) = after_open.find(']') else {
        return Err(usage(format!(
            "{ctx}: '[' has no matching ']'; write an IPv6 address as [fe80::1] or [fe80::1]:N"
        )));
    };
    let addr = &after_open[..close];
    let addr_ok = addr.contains(':')
        && addr
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, ':' | '.' | '%' | '-' | '_'));
    if !addr_ok {
        return Err(usage(format!(
            "{ctx}: [{addr}] is not an IPv6 address; brackets are only for IPv6 addresses, \
             as in [fe80::1]:4"
        )));
    }
    let rest = &after_open[close + 1..];
    let suffix = if rest.is_empty() {
        None
    } else if let Some(s) = rest.strip_prefix(':') {
        Some(s)
    } else {
        return Err(usage(format!(
            "{ctx}: unexpected {rest:?} after ']'; write [address] or [address]:N"
        )));
    };
    Ok((format!("{prefix}{addr}"), suffix))
}

/// One `-H` item or hostfile host token: a checked name and the slot count after ':', if any.
fn parse_item(item: &str, ctx: &str) -> Result<(String, Option<usize>)> {
    let (name, suffix) = split_host_suffix(item, ctx)?;
    check_name(&name, ctx)?;
    let slots = match suffix {
        Some(n) => Some(parse_count(n, ctx, "slot count")?),
        None => None,
    };
    Ok((name, slots))
}

/// Rejects names that cannot be an ssh destination, or that ssh would read as an option.
fn check_name(name: &str, ctx: &str) -> Result<()> {
    if name.is_empty() {
        return Err(usage(format!(
            "{ctx} has no host name; write a host name before any ':'"
        )));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(usage(format!(
            "{ctx}: the host name is longer than {MAX_NAME_LEN} characters; check for a missing separator"
        )));
    }
    if name.starts_with('-') {
        return Err(usage(format!(
            "{ctx}: host name {name:?} starts with '-', which ssh would read as an option; fix the name"
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, ',' | '[' | ']' | '=' | '#'))
    {
        return Err(usage(format!(
            "{ctx}: host name {name:?} contains {c:?}, which no host name has; fix the name"
        )));
    }
    if let Some((user, host)) = name.split_once('@')
        && (user.is_empty() || host.is_empty() || host.contains('@'))
    {
        return Err(usage(format!(
            "{ctx}: {name:?} is not a host or user@host; fix the name"
        )));
    }
    Ok(())
}

/// A slot count: a whole number from 1 to MAX_SLOTS.
fn parse_count(s: &str, ctx: &str, what: &str) -> Result<usize> {
    // Checked by hand: `str::parse` would also take "+4".
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(usage(format!(
            "{ctx}: {what} {s:?} is not a whole number; give a count from 1 to {MAX_SLOTS}"
        )));
    }
    match s.parse::<usize>() {
        Ok(0) => Err(usage(format!(
            "{ctx}: {what} is 0; give at least 1, or leave the host out"
        ))),
        Ok(n) if n <= MAX_SLOTS => Ok(n),
        _ => Err(usage(format!(
            "{ctx}: {what} {s} is too large; give a count from 1 to {MAX_SLOTS}"
        ))),
    }
}

/// Expands a Slurm hostlist expression (SLURM_JOB_NODELIST): "node[01-04,07]" ->
/// node01..node04,node07 (zero padding kept, width from the range's first number), several groups
/// separated by commas outside brackets ("gpu[1-2],cpu3"), several bracket groups in one name
/// ("r[1-2]n[1-2]" -> r1n1,r1n2,r2n1,r2n2), plain names. Reject malformed input (unbalanced
/// brackets, reversed ranges, non-numeric ranges) with a clear error. Cap the expansion at 100_000
/// names (error beyond) so a typo cannot exhaust memory.
pub(crate) fn expand_slurm_hostlist(s: &str) -> Result<Vec<String>> {
    let s = s.trim();
    if s.is_empty() {
        return Err(usage(
            "the Slurm node list is empty; run inside a Slurm allocation or give hosts with -H"
                .to_string(),
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(usage(format!(
            "the Slurm node list {s:?} contains {c:?}; write it without spaces, as in node[01-04],gpu7"
        )));
    }
    let mut groups = Vec::new();
    let mut total = 0usize;
    for group in split_top_level(s)? {
        if group.is_empty() {
            return Err(usage(format!(
                "the Slurm node list {s:?} has an empty name (two commas in a row, or one at an end); \
                 remove the extra comma"
            )));
        }
        if group.starts_with('-') {
            return Err(usage(format!(
                "the Slurm node list {s:?}: name {group:?} starts with '-', which ssh would read as an option"
            )));
        }
        let segs = parse_slurm_group(group, s)?;
        let count = segs
            .iter()
            .try_fold(1usize, |acc, seg| acc.checked_mul(seg.count()?));
        total = match count.and_then(|c| total.checked_add(c)) {
            Some(t) if t <= MAX_SLURM_NAMES => t,
            _ => {
                return Err(usage(format!(
                    "the Slurm node list {s:?} expands to more than {MAX_SLURM_NAMES} names; \
                     check the ranges for a typo"
                )));
            }
        };
        let longest: usize = segs.iter().map(Seg::max_len).sum();
        if longest > MAX_NAME_LEN {
            return Err(usage(format!(
                "the Slurm node list {s:?}: {group:?} makes names longer than {MAX_NAME_LEN} characters; \
                 check for a missing comma"
            )));
        }
        groups.push(segs);
    }

    let mut names = Vec::with_capacity(total);
    for segs in &groups {
        let mut partial = vec![String::new()];
        for seg in segs {
            partial = match seg {
                Seg::Lit(lit) => {
                    for p in &mut partial {
                        p.push_str(lit);
                    }
                    partial
                }
                Seg::Set(ranges) => {
                    let mut next =
                        Vec::with_capacity(partial.len().saturating_mul(seg_len(ranges)));
                    for p in &partial {
                        for r in ranges {
                            for n in r.start..=r.end {
                                next.push(format!("{p}{n:0w$}", w = r.width));
                            }
                        }
                    }
                    next
                }
            };
        }
        names.extend(partial);
    }

    let mut seen = HashSet::with_capacity(names.len());
    for name in &names {
        if !seen.insert(name.as_str()) {
            return Err(usage(format!(
                "the Slurm node list {s:?} names {name:?} more than once; list each node once"
            )));
        }
    }
    Ok(names)
}

/// Splits on commas outside brackets, checking that brackets balance and do not nest.
fn split_top_level(s: &str) -> Result<Vec<&str>> {
    let mut groups = Vec::new();
    let mut start = 0;
    let mut open = false;
    for (i, c) in s.char_indices() {
        match c {
            '[' if open => {
                return Err(usage(format!(
                    "the Slurm node list {s:?} has a '[' inside brackets; brackets do not nest, \
                     write e.g. node[1-4]"
                )));
            }
            '[' => open = true,
            ']' if !open => {
                return Err(usage(format!(
                    "the Slurm node list {s:?} has a ']' without a '['; check the brackets"
                )));
            }
            ']' => open = false,
            ',' if !open => {
                groups.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if open {
        return Err(usage(format!(
            "the Slurm node list {s:?} has a '[' without a ']'; check the brackets"
        )));
    }
    groups.push(&s[start..]);
    Ok(groups)
}

/// One piece of a Slurm name: literal text, or a bracketed set of numbers.
enum Seg<'a> {
    Lit(&'a str),
    Set(Vec<NumRange>),
}

/// `start..=end`, each printed zero-padded to `width` digits.
struct NumRange {
    start: u64,
    end: u64,
    width: usize,
}

impl Seg<'_> {
    /// How many alternatives this piece contributes; None when that overflows.
    fn count(&self) -> Option<usize> {
        match self {
            Seg::Lit(_) => Some(1),
            Seg::Set(ranges) => ranges.iter().try_fold(0usize, |acc, r| {
                let n = usize::try_from(r.end - r.start).ok()?.checked_add(1)?;
                acc.checked_add(n)
            }),
        }
    }

    /// The most characters this piece adds to a name.
    fn max_len(&self) -> usize {
        match self {
            Seg::Lit(lit) => lit.len(),
            Seg::Set(ranges) => ranges
                .iter()
                .map(|r| r.width.max(r.end.to_string().len()))
                .max()
                .unwrap_or(0),
        }
    }
}

/// The number of values in a set whose count was already checked to fit.
fn seg_len(ranges: &[NumRange]) -> usize {
    ranges.iter().map(|r| (r.end - r.start) as usize + 1).sum()
}

/// Parses one comma-free group (brackets already checked to balance) into its pieces.
fn parse_slurm_group<'a>(group: &'a str, whole: &str) -> Result<Vec<Seg<'a>>> {
    let mut segs = Vec::new();
    let mut rest = group;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            segs.push(Seg::Lit(&rest[..open]));
        }
        let inner_and_after = &rest[open + 1..];
        let Some(close) = inner_and_after.find(']') else {
            return Err(usage(format!(
                "the Slurm node list {whole:?} has a '[' without a ']'; check the brackets"
            )));
        };
        let inner = &inner_and_after[..close];
        segs.push(Seg::Set(parse_slurm_set(inner, whole)?));
        rest = &inner_and_after[close + 1..];
    }
    if !rest.is_empty() {
        segs.push(Seg::Lit(rest));
    }
    Ok(segs)
}

/// The inside of one pair of brackets: "01-04,07".
fn parse_slurm_set(inner: &str, whole: &str) -> Result<Vec<NumRange>> {
    if inner.is_empty() {
        return Err(usage(format!(
            "the Slurm node list {whole:?} has empty brackets; write numbers or ranges inside, as in node[1-4]"
        )));
    }
    let mut ranges = Vec::new();
    for item in inner.split(',') {
        if item.is_empty() {
            return Err(usage(format!(
                "the Slurm node list {whole:?} has an empty item in [{inner}]; remove the extra comma"
            )));
        }
        let range = match item.split_once('-') {
            Some((a, b)) => {
                let start = parse_slurm_num(a, item, whole)?;
                let end = parse_slurm_num(b, item, whole)?;
                if start > end {
                    return Err(usage(format!(
                        "the Slurm node list {whole:?} has the reversed range {item:?}; \
                         write the smaller number first"
                    )));
                }
                NumRange {
                    start,
                    end,
                    width: a.len(),
                }
            }
            None => {
                let n = parse_slurm_num(item, item, whole)?;
                NumRange {
                    start: n,
                    end: n,
                    width: item.len(),
                }
            }
        };
        ranges.push(range);
    }
    Ok(ranges)
}

fn parse_slurm_num(digits: &str, item: &str, whole: &str) -> Result<u64> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(usage(format!(
            "the Slurm node list {whole:?} has {item:?} in brackets, which is not a number or a range \
             like 01-04"
        )));
    }
    // 18 digits always fit in a u64 and are far beyond any node number.
    if digits.len() > 18 {
        return Err(usage(format!(
            "the Slurm node list {whole:?} has the number {digits:?}, which is too long; check for a typo"
        )));
    }
    digits.parse().map_err(|_| {
        usage(format!(
            "the Slurm node list {whole:?} has {item:?} in brackets, which is not a number"
        ))
    })
}

// ---- batch schedulers' node lists ----

/// Hosts in first-seen order with the slots counted for each: several lines or words naming
/// one host are that many slots of it, as PBS and LSF write them.
#[derive(Default)]
struct SlotCount {
    hosts: Vec<Host>,
    index: HashMap<String, usize>,
}

impl SlotCount {
    /// `n` more slots of `name`; `ctx` says where in messages.
    fn add(&mut self, name: &str, n: usize, ctx: &str) -> Result<()> {
        check_name(name, ctx)?;
        let i = match self.index.get(name) {
            Some(&i) => i,
            None if self.hosts.len() >= MAX_HOSTS => {
                return Err(usage(format!(
                    "{ctx}: more than {MAX_HOSTS} hosts; nrun drives at most {MAX_HOSTS} nodes \
                     from one launch host"
                )));
            }
            None => {
                self.index.insert(name.to_string(), self.hosts.len());
                self.hosts.push(Host {
                    name: name.to_string(),
                    slots: Some(0),
                    only_slots: None,
                });
                self.hosts.len() - 1
            }
        };
        let slots = self.hosts[i].slots.unwrap_or(0).saturating_add(n);
        if slots > MAX_SLOTS {
            return Err(usage(format!(
                "{ctx}: host {name:?} has more than {MAX_SLOTS} slots; check the file"
            )));
        }
        self.hosts[i].slots = Some(slots);
        Ok(())
    }

    fn done(self, origin: &str, example: &str) -> Result<Vec<Host>> {
        if self.hosts.is_empty() {
            return Err(usage(format!(
                "{origin} lists no hosts; the scheduler writes {example}; check that the job \
                 runs inside the allocation, or give the hosts with -H"
            )));
        }
        Ok(self.hosts)
    }
}

/// A node file of one host per slot, as PBS/Torque writes `$PBS_NODEFILE` and LSF
/// `$LSB_DJOB_HOSTFILE`: `node1` on 8 lines is node1 with 8 slots. Hosts keep the order of
/// their first line; blank lines are skipped; anything else on a line is an error naming it.
pub(crate) fn parse_slot_lines(text: &str, origin: &str) -> Result<Vec<Host>> {
    let mut count = SlotCount::default();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let ctx = format!("{origin} line {}", i + 1);
        if line.contains(char::is_whitespace) {
            return Err(usage(format!(
                "{ctx}: {line:?} is not one host name; this file lists one host per line, \
                 once per slot"
            )));
        }
        count.add(line, 1, &ctx)?;
    }
    count.done(origin, "one host name per line, once per slot")
}

/// LSF's `LSB_HOSTS`: host names separated by spaces, once per slot (`h1 h1 h2 h2`).
pub(crate) fn parse_lsb_hosts(s: &str) -> Result<Vec<Host>> {
    let mut count = SlotCount::default();
    for name in s.split_whitespace() {
        count.add(name, 1, "$LSB_HOSTS")?;
    }
    count.done(
        "$LSB_HOSTS",
        "host names once per slot, as in \"h1 h1 h2 h2\"",
    )
}

/// LSF's `LSB_MCPU_HOSTS`: pairs of a host and its slots, `hostA 8 hostB 8`.
pub(crate) fn parse_lsf_mcpu_hosts(s: &str) -> Result<Vec<Host>> {
    let words: Vec<&str> = s.split_whitespace().collect();
    if words.len() % 2 == 1 {
        return Err(usage(format!(
            "$LSB_MCPU_HOSTS {s:?} has a host without its slot count; LSF writes pairs, as in \
             \"hostA 8 hostB 8\""
        )));
    }
    let mut count = SlotCount::default();
    for pair in words.chunks(2) {
        let ctx = format!("$LSB_MCPU_HOSTS host {:?}", pair[0]);
        let n = parse_count(pair[1], &ctx, "slot count")?;
        count.add(pair[0], n, &ctx)?;
    }
    count.done("$LSB_MCPU_HOSTS", "pairs of a host and its slots")
}

/// SGE/UGE's `$PE_HOSTFILE`: `host slots queue processor-range` per line
/// (`node01 4 all.q@node01 UNDEFINED`); a host on several lines (several queues) has their
/// slots together. Only the host and slots are read.
pub(crate) fn parse_pe_hostfile(text: &str, origin: &str) -> Result<Vec<Host>> {
    let mut count = SlotCount::default();
    for (i, raw) in text.lines().enumerate() {
        let mut words = raw.split_whitespace();
        let Some(name) = words.next() else {
            continue;
        };
        let ctx = format!("{origin} line {}", i + 1);
        let Some(slots) = words.next() else {
            return Err(usage(format!(
                "{ctx}: {name:?} has no slot count; SGE writes `host slots queue \
                 processor-range` per line"
            )));
        };
        let n = parse_count(slots, &ctx, "slot count")?;
        count.add(name, n, &ctx)?;
    }
    count.done(origin, "`host slots queue processor-range` per line")
}

/// DeepSpeed's include/exclude syntax: "worker-0@worker-1:0,2" means all of worker-0, and slots 0
/// and 2 of worker-1 (hosts separated by '@', slots after ':' comma separated). `include` keeps
/// only those (setting only_slots where slots are given), `exclude` removes whole hosts (no slots)
/// or the given slots of a host (setting only_slots to the remaining slots, which requires the
/// host's slot count to be known -> error otherwise). Both given -> usage error "--include and
/// --exclude exclude each other". A named host that is not in the list -> error naming it and
/// listing the known hosts (suggest the closest name if one differs by a small edit distance).
pub(crate) fn apply_include_exclude(
    hosts: Vec<Host>,
    include: Option<&str>,
    exclude: Option<&str>,
) -> Result<Vec<Host>> {
    match (include, exclude) {
        (None, None) => Ok(hosts),
        (Some(_), Some(_)) => Err(usage(
            "--include and --exclude exclude each other; give only one of them".to_string(),
        )),
        (Some(spec), None) => include_hosts(hosts, spec),
        (None, Some(spec)) => exclude_hosts(hosts, spec),
    }
}

/// One `host` or `host:0,2` of an include/exclude spec.
struct Selection {
    /// Index into the host list.
    index: usize,
    /// Sorted, distinct; None = the whole host.
    slots: Option<Vec<usize>>,
}

fn parse_selection(hosts: &[Host], spec: &str, flag: &str) -> Result<Vec<Selection>> {
    if spec.trim().is_empty() {
        return Err(usage(format!(
            "{flag} is empty; name hosts separated by '@', as in worker-0@worker-1:0,2"
        )));
    }
    let index: HashMap<&str, usize> = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (h.name.as_str(), i))
        .collect();
    let mut out: Vec<Selection> = Vec::new();
    for raw in spec.split('@') {
        let item = raw.trim();
        if item.is_empty() {
            return Err(usage(format!(
                "{flag} {spec:?} has an empty host (two '@' in a row, or one at an end); \
                 write e.g. worker-0@worker-1:0,2"
            )));
        }
        let ctx = format!("{flag} item {item:?}");
        let (name, suffix) = split_host_suffix(item, &ctx)?;
        let Some(&i) = index.get(name.as_str()) else {
            return Err(unknown_host(flag, &name, hosts));
        };
        if out.iter().any(|s| s.index == i) {
            return Err(usage(format!(
                "{flag} names host {name:?} twice; name it once, with all its slots after ':'"
            )));
        }
        let slots = match suffix {
            None => None,
            Some(list) => Some(parse_slot_list(list, &ctx)?),
        };
        out.push(Selection { index: i, slots });
    }
    Ok(out)
}

/// "0,2" -> [0, 2]: slot indices, sorted, each once.
fn parse_slot_list(list: &str, ctx: &str) -> Result<Vec<usize>> {
    let mut slots = Vec::new();
    for raw in list.split(',') {
        let s = raw.trim();
        if s.is_empty() {
            return Err(usage(format!(
                "{ctx} has an empty slot; list slot numbers after ':', as in worker-1:0,2"
            )));
        }
        let n = if s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse::<usize>().ok().filter(|&n| n < MAX_SLOTS)
        } else {
            None
        };
        let Some(n) = n else {
            return Err(usage(format!(
                "{ctx}: slot {s:?} is not a slot number; list numbers from 0, as in worker-1:0,2"
            )));
        };
        if slots.contains(&n) {
            return Err(usage(format!(
                "{ctx} names slot {n} twice; name each slot once"
            )));
        }
        slots.push(n);
    }
    slots.sort_unstable();
    Ok(slots)
}

/// The slots a host may run today: its only_slots, else all of its slots; None when unknown.
fn available_slots(host: &Host) -> Option<Vec<usize>> {
    match (&host.only_slots, host.slots) {
        (Some(only), _) => Some(only.clone()),
        (None, Some(n)) => Some((0..n.min(MAX_SLOTS)).collect()),
        (None, None) => None,
    }
}

fn describe_slots(available: &[usize]) -> String {
    let contiguous = available.iter().enumerate().all(|(i, &s)| i == s);
    match available {
        [] => "no slots".to_string(),
        [only] => format!("only slot {only}"),
        [.., last] if contiguous => format!("slots 0-{last}"),
        _ => format!(
            "slots {}",
            join_limited(available.iter().map(|s| s.to_string()))
        ),
    }
}

fn include_hosts(hosts: Vec<Host>, spec: &str) -> Result<Vec<Host>> {
    let selection = parse_selection(&hosts, spec, "--include")?;
    let mut chosen: HashMap<usize, Option<Vec<usize>>> = HashMap::new();
    for sel in selection {
        if let Some(wanted) = &sel.slots {
            let host = &hosts[sel.index];
            if let Some(available) = available_slots(host)
                && let Some(bad) = wanted.iter().find(|s| !available.contains(s))
            {
                return Err(usage(format!(
                    "--include asks for slot {bad} of host {:?}, which has {}; \
                         name only slots it has",
                    host.name,
                    describe_slots(&available)
                )));
            }
        }
        chosen.insert(sel.index, sel.slots);
    }
    // Host-list order, not the order of the spec: rank order follows the host list.
    Ok(hosts
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut host)| {
            let slots = chosen.remove(&i)?;
            if slots.is_some() {
                host.only_slots = slots;
            }
            Some(host)
        })
        .collect())
}

fn exclude_hosts(hosts: Vec<Host>, spec: &str) -> Result<Vec<Host>> {
    let selection = parse_selection(&hosts, spec, "--exclude")?;
    // Index -> None (drop the host) or Some(slots it keeps).
    let mut changes: HashMap<usize, Option<Vec<usize>>> = HashMap::new();
    for sel in selection {
        let host = &hosts[sel.index];
        let keep = match sel.slots {
            None => None,
            Some(dropped) => {
                let Some(available) = available_slots(host) else {
                    return Err(usage(format!(
                        "--exclude drops slots of host {:?}, but its slot count is unknown; \
                         give it as {}:N in -H or with slots=N in the hostfile, \
                         or exclude the whole host",
                        host.name, host.name
                    )));
                };
                if let Some(bad) = dropped.iter().find(|s| !available.contains(s)) {
                    return Err(usage(format!(
                        "--exclude drops slot {bad} of host {:?}, which has {}; \
                         name only slots it has",
                        host.name,
                        describe_slots(&available)
                    )));
                }
                let kept: Vec<usize> = available
                    .into_iter()
                    .filter(|s| !dropped.contains(s))
                    .collect();
                // Excluding every slot is excluding the host.
                (!kept.is_empty()).then_some(kept)
            }
        };
        changes.insert(sel.index, keep);
    }
    let kept: Vec<Host> = hosts
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut host)| match changes.remove(&i) {
            None => Some(host),
            Some(None) => None,
            Some(Some(slots)) => {
                host.only_slots = Some(slots);
                Some(host)
            }
        })
        .collect();
    if kept.is_empty() {
        return Err(usage(format!(
            "--exclude {spec:?} leaves no hosts; exclude fewer"
        )));
    }
    Ok(kept)
}

fn unknown_host(flag: &str, name: &str, hosts: &[Host]) -> Error {
    let known = join_limited(hosts.iter().map(|h| h.name.clone()));
    let hint = match closest(name, hosts) {
        Some(near) => format!("; did you mean {near:?}?"),
        None => String::new(),
    };
    if hosts.is_empty() {
        return usage(format!(
            "{flag} names host {name:?}, but the host list is empty; give hosts with -H or a hostfile"
        ));
    }
    usage(format!(
        "{flag} names host {name:?}, which is not in the host list (known: {known}){hint}"
    ))
}

/// The known name nearest to `name`, if only a small edit away (a typo, not another host).
fn closest<'a>(name: &str, hosts: &'a [Host]) -> Option<&'a str> {
    let len = name.chars().count();
    // Long names would make the distance costly and are not typed by hand.
    if len > 128 {
        return None;
    }
    let limit = if len >= 4 { 2 } else { 1 };
    hosts
        .iter()
        .map(|h| h.name.as_str())
        .filter(|h| h.chars().count().abs_diff(len) <= limit && h.len() <= 512)
        .map(|h| (edit_distance(name, h), h))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, h)| h)
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != cb);
            cur[j + 1] = substitute.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// "a, b, c" with at most LIST_SHOWN items, then "and N more".
fn join_limited(items: impl ExactSizeIterator<Item = String>) -> String {
    let total = items.len();
    let shown: Vec<String> = items.take(LIST_SHOWN).collect();
    let mut out = shown.join(", ");
    if total > LIST_SHOWN {
        out.push_str(&format!(" and {} more", total - LIST_SHOWN));
    }
    out
}

/// `--nnodes N` takes the first N hosts; error if fewer are known ("--nnodes 4 but the host list
/// has 3 hosts: a, b, c").
pub(crate) fn take_nnodes(mut hosts: Vec<Host>, nnodes: usize) -> Result<Vec<Host>> {
    if nnodes == 0 {
        return Err(usage(
            "--nnodes 0 asks for no nodes; give at least 1".to_string(),
        ));
    }
    if hosts.len() < nnodes {
        let have = match hosts.len() {
            0 => "no hosts".to_string(),
            1 => format!("1 host: {}", hosts[0].name),
            n => format!(
                "{n} hosts: {}",
                join_limited(hosts.iter().map(|h| h.name.clone()))
            ),
        };
        return Err(usage(format!(
            "--nnodes {nnodes} but the host list has {have}; give more hosts or a smaller --nnodes"
        )));
    }
    hosts.truncate(nnodes);
    Ok(hosts)
}

/// Ranks are contiguous per node in host order. Given the hosts and the requested workers per node
/// (nproc), returns per node the list of (global rank, local rank, slot index). A node's slot count
/// limits its workers: if nproc > slots -> error naming the host ("host b has 4 slots but
/// --nproc-per-node 8 asks for 8 workers"). With only_slots set, the node runs exactly those slots
/// (its worker count is their number; local ranks 0..k in slot order; the slot index is kept so the
/// caller can pin GPUs).
pub(crate) fn rank_layout(hosts: &[Host], nproc: usize) -> Result<Vec<Vec<(usize, usize, usize)>>> {
    if hosts.is_empty() {
        return Err(usage(
            "the host list is empty; give hosts with -H or a hostfile".to_string(),
        ));
    }
    let mut next_rank = 0usize;
    let mut layout = Vec::with_capacity(hosts.len());
    for host in hosts {
        // Slot indices this node runs, as a count plus a way to get the i-th, so nothing is
        // allocated before the total is known to be sane.
        let slots: Option<Vec<usize>> = match &host.only_slots {
            Some(only) => Some(checked_only_slots(host, only)?),
            None => None,
        };
        let count = match &slots {
            Some(s) => s.len(),
            None => {
                if nproc == 0 {
                    return Err(usage(
                        "--nproc-per-node 0 asks for no workers; give at least 1".to_string(),
                    ));
                }
                if let Some(n) = host.slots
                    && nproc > n
                {
                    return Err(usage(format!(
                        "host {} has {n} slot{} but --nproc-per-node {nproc} asks for {nproc} workers; \
                             lower --nproc-per-node or raise the host's slot count",
                        host.name,
                        if n == 1 { "" } else { "s" }
                    )));
                }
                nproc
            }
        };
        let end = match next_rank.checked_add(count) {
            Some(e) if e <= MAX_WORKERS => e,
            _ => {
                return Err(usage(format!(
                    "the job would have more than {MAX_WORKERS} workers; check --nproc-per-node \
                     and the host list"
                )));
            }
        };
        let node: Vec<(usize, usize, usize)> = (0..count)
            .map(|local| {
                let slot = slots.as_ref().map_or(local, |s| s[local]);
                (next_rank + local, local, slot)
            })
            .collect();
        layout.push(node);
        next_rank = end;
    }
    Ok(layout)
}

/// A host's only_slots, sorted, after checking they are distinct and within its slot count.
fn checked_only_slots(host: &Host, only: &[usize]) -> Result<Vec<usize>> {
    if only.is_empty() {
        return Err(usage(format!(
            "host {} is left with no slots to run; include at least one slot or leave the host out",
            host.name
        )));
    }
    let mut sorted = only.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(usage(format!(
            "host {} lists slot {} twice; name each slot once",
            host.name, w[0]
        )));
    }
    if let (Some(n), Some(&last)) = (host.slots, sorted.last())
        && last >= n
    {
        return Err(usage(format!(
            "host {} has {n} slots (0-{}) but slot {last} is asked for; name only slots it has",
            host.name,
            n.saturating_sub(1)
        )));
    }
    Ok(sorted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, slots: Option<usize>) -> Host {
        Host {
            name: name.to_string(),
            slots,
            only_slots: None,
        }
    }

    fn names(hosts: &[Host]) -> Vec<&str> {
        hosts.iter().map(|h| h.name.as_str()).collect()
    }

    /// The error message, asserting the input was rejected as bad usage.
    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        let e = r.expect_err("expected an error");
        assert_eq!(e.code, nrun_base::error::exit::USAGE, "{}", e.message);
        assert!(!e.message.contains('\n'), "one line: {}", e.message);
        assert!(
            e.message.starts_with(|c: char| !c.is_uppercase()),
            "lower-case start: {}",
            e.message
        );
        e.message
    }

    // ---- -H/--hosts ----

    #[test]
    fn flag_plain_names() {
        let h = parse_hosts_flag("h1,h2").unwrap();
        assert_eq!(h, vec![host("h1", None), host("h2", None)]);
    }

    #[test]
    fn flag_slots_and_whitespace() {
        let h = parse_hosts_flag("  h1:8 , h2:4,h3 ").unwrap();
        assert_eq!(
            h,
            vec![host("h1", Some(8)), host("h2", Some(4)), host("h3", None)]
        );
    }

    #[test]
    fn flag_user_at_host_and_addresses() {
        let h = parse_hosts_flag("alice@h1:2,10.0.0.7:8").unwrap();
        assert_eq!(
            h,
            vec![host("alice@h1", Some(2)), host("10.0.0.7", Some(8))]
        );
    }

    #[test]
    fn flag_ipv6_in_brackets() {
        let h = parse_hosts_flag("[fe80::1]:4,[::1],bob@[2001:db8::2]:1,[fe80::3%eth0]").unwrap();
        assert_eq!(
            h,
            vec![
                host("fe80::1", Some(4)),
                host("::1", None),
                host("bob@2001:db8::2", Some(1)),
                host("fe80::3%eth0", None),
            ]
        );
    }

    #[test]
    fn flag_bare_ipv6_asks_for_brackets() {
        assert!(err(parse_hosts_flag("fe80::1")).contains("brackets"));
    }

    #[test]
    fn flag_bad_brackets() {
        for bad in [
            "[fe80::1",
            "[host]",
            "[]:4",
            "a[fe80::1]",
            "[fe80::1]4",
            "[fe80::1]:",
            "[fe80::1]:x",
            "[fe 80::1]",
        ] {
            err(parse_hosts_flag(bad));
        }
    }

    #[test]
    fn flag_empty_items_rejected() {
        assert!(err(parse_hosts_flag("")).contains("empty"));
        assert!(err(parse_hosts_flag("   ")).contains("empty"));
        assert!(err(parse_hosts_flag("a,,b")).contains("empty item (number 2)"));
        assert!(err(parse_hosts_flag(",a")).contains("empty item (number 1)"));
        assert!(err(parse_hosts_flag("a, ")).contains("empty item (number 2)"));
    }

    #[test]
    fn flag_duplicate_names_host() {
        let m = err(parse_hosts_flag("a:2,b,a:4"));
        assert!(m.contains("\"a\" twice"), "{m}");
        assert!(m.contains("items 1 and 3"), "{m}");
    }

    #[test]
    fn flag_bad_slot_counts() {
        for (bad, needle) in [
            ("a:", "not a whole number"),
            ("a:x", "not a whole number"),
            ("a:+4", "not a whole number"),
            ("a:-1", "not a whole number"),
            ("a:4.5", "not a whole number"),
            ("a:0", "is 0"),
            ("a:99999999999999999999999", "too large"),
            ("a:2000000", "too large"),
            ("a:1:2", "more than one ':'"),
        ] {
            let m = err(parse_hosts_flag(bad));
            assert!(m.contains(needle), "{bad}: {m}");
            assert!(m.contains("-H/--hosts"), "{bad}: {m}");
        }
    }

    #[test]
    fn flag_bad_names() {
        for bad in [
            ":4",
            "-oProxyCommand=x",
            "a b",
            "@h",
            "u@",
            "a@b@c",
            "a]",
            "a=b",
            "tab\there",
        ] {
            err(parse_hosts_flag(bad));
        }
        let long = "x".repeat(300);
        assert!(err(parse_hosts_flag(&long)).contains("longer than"));
    }

    // ---- hostfiles ----

    #[test]
    fn host_count_is_bounded() {
        let names: Vec<String> = (0..=MAX_HOSTS).map(|i| format!("h{i}")).collect();
        let e = err(parse_hosts_flag(&names.join(",")));
        assert!(e.contains("more than 16384 hosts"), "{e}");
        assert_eq!(
            parse_hosts_flag(&names[..MAX_HOSTS].join(","))
                .unwrap()
                .len(),
            MAX_HOSTS
        );
        let text = names.join("\n");
        let e = err(parse_hostfile(&text, "hosts"));
        assert!(
            e.contains("hosts: more than 16384 hosts (line 16385"),
            "{e}"
        );
        let text = format!("# many\n{}\n", names[..MAX_HOSTS].join("\n"));
        assert_eq!(parse_hostfile(&text, "hosts").unwrap().len(), MAX_HOSTS);
    }

    #[test]
    fn hostfile_all_forms() {
        let text = "node1 slots=8\nnode2:4\nnode3\nnode4 slots=2 max_slots=16\nnode5 max_slots=3\n";
        let h = parse_hostfile(text, "hosts.txt").unwrap();
        assert_eq!(
            h,
            vec![
                host("node1", Some(8)),
                host("node2", Some(4)),
                host("node3", None),
                host("node4", Some(2)),
                host("node5", None),
            ]
        );
    }

    #[test]
    fn hostfile_comments_blank_lines_and_crlf() {
        let text = "# cluster A\n\n   \nnode1 slots=8   # the big one\r\n\t# indented comment\nnode2#tight\n  node3  slots=2  \n#";
        let h = parse_hostfile(text, "hf").unwrap();
        assert_eq!(
            h,
            vec![
                host("node1", Some(8)),
                host("node2", None),
                host("node3", Some(2))
            ]
        );
    }

    #[test]
    fn hostfile_ipv6_and_user() {
        let h = parse_hostfile("[fe80::1] slots=2\n[fe80::2]:4\nme@n1 slots=1\n", "hf").unwrap();
        assert_eq!(
            h,
            vec![
                host("fe80::1", Some(2)),
                host("fe80::2", Some(4)),
                host("me@n1", Some(1))
            ]
        );
    }

    #[test]
    fn hostfile_duplicate_names_both_lines() {
        let text = "a\nb\nc slots=2\n# x\n\nd\nc slots=4\n";
        let m = err(parse_hostfile(text, "/etc/hosts.nrun"));
        assert!(m.contains("line 3 and line 7"), "{m}");
        assert!(m.contains("\"c\""), "{m}");
        assert!(m.contains("/etc/hosts.nrun"), "{m}");
    }

    #[test]
    fn hostfile_unknown_key_named() {
        let m = err(parse_hostfile("a slots=2\nb cpus=4\n", "hf"));
        assert!(m.contains("hf line 2"), "{m}");
        assert!(m.contains("\"cpus\""), "{m}");
    }

    #[test]
    fn hostfile_malformed_lines() {
        for (text, needle) in [
            ("a slots=x", "not a whole number"),
            ("a slots=", "not a whole number"),
            ("a slots=0", "is 0"),
            ("a max_slots=x", "not a whole number"),
            ("a slots=2 slots=3", "twice"),
            ("a max_slots=2 max_slots=3", "twice"),
            ("a:2 slots=3", "twice"),
            ("a slots = 4", "no spaces"),
            ("a 4", "unexpected"),
            ("slots=4", "starts with the host name"),
            ("a:b", "not a whole number"),
            ("-a", "starts with '-'"),
            ("[fe80::1", "no matching"),
        ] {
            let m = err(parse_hostfile(&format!("ok\n{text}\n"), "hf"));
            assert!(m.contains("hf line 2"), "{text}: {m}");
            assert!(m.contains(needle), "{text}: {m}");
        }
    }

    #[test]
    fn hostfile_without_hosts() {
        assert!(err(parse_hostfile("", "hf")).contains("hf lists no hosts"));
        assert!(err(parse_hostfile("# only\n\n  # comments\n", "hf")).contains("no hosts"));
    }

    // ---- filter_hostfile ----

    /// Keeps every host except those in `drop`.
    fn filter_out(text: &str, drop: &[&str]) -> String {
        filter_hostfile(text, "hf", &|name| !drop.contains(&name)).unwrap()
    }

    #[test]
    fn filter_keeps_every_form_byte_for_byte() {
        let text = "node1 slots=8\nnode2:4\nnode3\nnode4  slots=2 max_slots=16\n";
        assert_eq!(filter_out(text, &[]), text);
    }

    #[test]
    fn filter_drops_one_host_among_several() {
        let text = "node1 slots=8\nnode2:4\nnode3\nnode4 slots=2\n";
        assert_eq!(
            filter_out(text, &["node2"]),
            "node1 slots=8\nnode3\nnode4 slots=2\n"
        );
        assert_eq!(
            filter_out(text, &["node1"]),
            "node2:4\nnode3\nnode4 slots=2\n"
        );
        assert_eq!(
            filter_out(text, &["node3"]),
            "node1 slots=8\nnode2:4\nnode4 slots=2\n"
        );
    }

    #[test]
    fn filter_keeps_comments_and_blank_lines() {
        let text =
            "# cluster A\n\n   \nnode1 slots=8   # the big one\n\t# gpu nodes\nnode2#tight\n";
        assert_eq!(filter_out(text, &[]), text);
        // A dropped host's trailing comment goes with it; other comments stay.
        assert_eq!(
            filter_out(text, &["node1"]),
            "# cluster A\n\n   \n\t# gpu nodes\nnode2#tight\n"
        );
        assert_eq!(
            filter_out(text, &["node2"]),
            "# cluster A\n\n   \nnode1 slots=8   # the big one\n\t# gpu nodes\n"
        );
    }

    #[test]
    fn filter_ipv6_and_user_compare_with_host_name() {
        // keep() sees Host::name, brackets dropped; the kept line keeps them.
        let text = "[fe80::1]:4\n[fe80::2] slots=2\nme@[fe80::3]:1\nme@n1 slots=1\n";
        assert_eq!(parse_hostfile(text, "hf").unwrap()[2].name, "me@fe80::3");
        assert_eq!(
            filter_out(text, &["fe80::2", "me@n1"]),
            "[fe80::1]:4\nme@[fe80::3]:1\n"
        );
        assert_eq!(
            filter_out(text, &["fe80::1", "me@fe80::3"]),
            "[fe80::2] slots=2\nme@n1 slots=1\n"
        );
    }

    #[test]
    fn filter_passes_names_as_parse_hostfile_does() {
        let text = "# c\n[fe80::1]:4 # x\nme@n1 slots=1\nnode2:3\n\n";
        let seen = std::cell::RefCell::new(Vec::new());
        filter_hostfile(text, "hf", &|name| {
            seen.borrow_mut().push(name.to_string());
            true
        })
        .unwrap();
        let parsed = parse_hostfile(text, "hf").unwrap();
        assert_eq!(seen.into_inner(), names(&parsed));
    }

    #[test]
    fn filter_ends_every_line_with_newline() {
        assert_eq!(filter_out("a\n# end", &[]), "a\n# end\n");
        assert_eq!(filter_out("a\nb", &["a"]), "b\n");
        // Split as str::lines, so CRLF comes out as LF.
        assert_eq!(filter_out("a\r\nb\r\n", &[]), "a\nb\n");
        // Dropping every host is the caller's call, not an error.
        assert_eq!(filter_out("# x\na\n", &["a"]), "# x\n");
    }

    #[test]
    fn filter_rejects_what_parse_hostfile_rejects() {
        for text in [
            "ok\nfe80::1 slots=2\n", // bare IPv6 needs brackets, as in parse_hostfile
            "ok\na slots=x\n",
            "ok\na cpus=4\n",
            "ok\n[fe80::1\n",
            "a\nb\na:2\n",
            "# only comments\n\n",
            "",
        ] {
            let want = err(parse_hostfile(text, "hf"));
            assert_eq!(
                err(filter_hostfile(text, "hf", &|_| true)),
                want,
                "{text:?}"
            );
        }
        assert!(err(parse_hostfile("fe80::1 slots=2\n", "hf")).contains("brackets"));
    }

    // ---- Slurm ----

    fn slurm(s: &str) -> Vec<String> {
        expand_slurm_hostlist(s).unwrap()
    }

    #[test]
    fn slurm_plain_names() {
        assert_eq!(slurm("node7"), ["node7"]);
        assert_eq!(slurm("a,b,c"), ["a", "b", "c"]);
        assert_eq!(slurm(" a \n"), ["a"]);
    }

    #[test]
    fn slurm_ranges_keep_padding() {
        assert_eq!(
            slurm("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(slurm("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(slurm("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(slurm("n[3,05]"), ["n3", "n05"]);
        assert_eq!(slurm("n[0-0]"), ["n0"]);
    }

    #[test]
    fn slurm_several_groups() {
        assert_eq!(slurm("gpu[1-2],cpu3"), ["gpu1", "gpu2", "cpu3"]);
        assert_eq!(slurm("a[1-2],b,c[09-10]"), ["a1", "a2", "b", "c09", "c10"]);
    }

    #[test]
    fn slurm_several_brackets_in_one_name() {
        assert_eq!(slurm("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(slurm("[1-2]x"), ["1x", "2x"]);
        assert_eq!(
            slurm("rack[1,3]-node[01-02].ib"),
            [
                "rack1-node01.ib",
                "rack1-node02.ib",
                "rack3-node01.ib",
                "rack3-node02.ib"
            ]
        );
    }

    #[test]
    fn slurm_malformed() {
        for (bad, needle) in [
            ("", "empty"),
            ("node[1-2", "without a ']'"),
            ("node1-2]", "without a '['"),
            ("node[[1-2]]", "do not nest"),
            ("node[]", "empty brackets"),
            ("node[1,,2]", "empty item"),
            ("node[1,]", "empty item"),
            ("node[4-2]", "reversed"),
            ("node[a-b]", "not a number"),
            ("node[1-b]", "not a number"),
            ("node[1-2-3]", "not a number"),
            ("node[1-]", "not a number"),
            ("node[-2]", "not a number"),
            ("node[+2]", "not a number"),
            ("a,,b", "empty name"),
            ("a,", "empty name"),
            (",a", "empty name"),
            ("a b", "without spaces"),
            ("-a", "starts with '-'"),
            ("n[1234567890123456789]", "too long"),
            ("a,a", "more than once"),
            ("n[1-3],n2", "more than once"),
        ] {
            let m = err(expand_slurm_hostlist(bad));
            assert!(m.contains(needle), "{bad:?}: {m}");
        }
    }

    #[test]
    fn slurm_expansion_is_capped() {
        assert_eq!(expand_slurm_hostlist("n[1-100000]").unwrap().len(), 100_000);
        for bad in [
            "n[1-100001]",
            "n[0-999999999999999999]",
            "a[1-1000]b[1-1000]",
            "a[1-60000],b[1-60000]",
            "a[0-999999999999999999]b[0-999999999999999999]c[0-999999999999999999]",
        ] {
            assert!(
                err(expand_slurm_hostlist(bad)).contains("more than 100000"),
                "{bad}"
            );
        }
        let long = format!("{}[1-100000]", "x".repeat(1000));
        assert!(err(expand_slurm_hostlist(&long)).contains("longer than"));
    }

    // ---- hostlist ranges in -H and hostfiles ----

    #[test]
    fn flag_ranges_expand() {
        // docs/spares.md's own example, and Slurm's forms with slots and a user.
        assert_eq!(
            parse_hosts_flag("gpu[1-5]").unwrap(),
            (1..=5)
                .map(|i| host(&format!("gpu{i}"), None))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            parse_hosts_flag("gpu[01-02,07]:8,cpu1").unwrap(),
            vec![
                host("gpu01", Some(8)),
                host("gpu02", Some(8)),
                host("gpu07", Some(8)),
                host("cpu1", None),
            ]
        );
        assert_eq!(
            names(&parse_hosts_flag("alice@r[1-2]n[1-2].ib:2").unwrap()),
            [
                "alice@r1n1.ib",
                "alice@r1n2.ib",
                "alice@r2n1.ib",
                "alice@r2n2.ib"
            ]
        );
        // IPv6 in brackets stays an address beside ranges.
        assert_eq!(
            parse_hosts_flag("[::1]:2,n[1-2],bob@[fe80::1]").unwrap(),
            vec![
                host("::1", Some(2)),
                host("n1", None),
                host("n2", None),
                host("bob@fe80::1", None),
            ]
        );
    }

    #[test]
    fn flag_bad_ranges_say_what() {
        for (bad, needle) in [
            ("gpu[3-1]", "reversed range"),
            ("gpu[1-2", "'[' without a ']'"),
            ("gpu[a-b]", "not a number"),
            ("gpu[1-2]:0", "is 0"),
            ("gpu[1-2]:4:4", "more than one ':'"),
            ("gpu[1-3],gpu2", "\"gpu2\" twice (items 1 and 2)"),
            (
                "gpu[1-20000]",
                "expands to 20000 hosts, more than the 16384",
            ),
            ("-x[1-2]", "starts with '-'"),
        ] {
            let m = err(parse_hosts_flag(bad));
            assert!(m.contains(needle), "{bad}: {m}");
            assert!(m.contains("-H/--hosts"), "{bad}: {m}");
            assert!(!m.contains("Slurm"), "{bad}: {m}");
        }
    }

    #[test]
    fn hostfile_ranges_expand_and_filter() {
        let text = "# rack 1\ngpu[01-03] slots=8\ncpu[1-2]:2 # cpus\nlone\n";
        let h = parse_hostfile(text, "hf").unwrap();
        assert_eq!(
            h,
            vec![
                host("gpu01", Some(8)),
                host("gpu02", Some(8)),
                host("gpu03", Some(8)),
                host("cpu1", Some(2)),
                host("cpu2", Some(2)),
                host("lone", None),
            ]
        );
        // Whole lines are kept as written; a range with hosts dropped lists the rest.
        let kept = filter_hostfile(text, "hf", &|n| n != "gpu02" && n != "cpu1").unwrap();
        assert_eq!(
            kept,
            "# rack 1\ngpu01 slots=8\ngpu03 slots=8\ncpu2 slots=2\nlone\n"
        );
        // $PBS_NODEFILE given as a hostfile: the way to give it is named.
        let m = err(parse_hostfile("n1\nn1\n", "hf"));
        assert!(m.contains("read without --hostfile"), "{m}");
        let m = err(parse_hostfile("n[1-3]\nn2\n", "hf"));
        assert!(
            m.contains("\"n2\" is listed twice, on line 1 and line 2"),
            "{m}"
        );
        let m = err(parse_hostfile("n1\nn[1-2-3]\n", "hf"));
        assert!(m.contains("hf line 2"), "{m}");
    }

    // ---- batch schedulers' node lists, as each scheduler writes them ----

    #[test]
    fn pbs_nodefile_lines_are_slots() {
        // Torque, `qsub -l nodes=3:ppn=4`: each host once per processor, in order.
        let torque = "node01\nnode01\nnode01\nnode01\nnode02\nnode02\nnode02\nnode02\n\
                      node03\nnode03\nnode03\nnode03\n";
        assert_eq!(
            parse_slot_lines(torque, "PBS_NODEFILE").unwrap(),
            vec![
                host("node01", Some(4)),
                host("node02", Some(4)),
                host("node03", Some(4)),
            ]
        );
        // PBS Pro, `-l select=2:ncpus=8:mpiprocs=2` (mpiprocs lines per chunk, full names).
        let pro = "gpu-a01.cluster.local\ngpu-a01.cluster.local\n\
                   gpu-a02.cluster.local\ngpu-a02.cluster.local\n";
        assert_eq!(
            parse_slot_lines(pro, "PBS_NODEFILE").unwrap(),
            vec![
                host("gpu-a01.cluster.local", Some(2)),
                host("gpu-a02.cluster.local", Some(2)),
            ]
        );
        // Chunks of one host apart still count together; order is first seen.
        assert_eq!(
            parse_slot_lines("b\na\nb\n", "PBS_NODEFILE").unwrap(),
            vec![host("b", Some(2)), host("a", Some(1))]
        );
    }

    #[test]
    fn pbs_nodefile_errors_name_the_line() {
        let m = err(parse_slot_lines("n1\nn2 slots=4\n", "$PBS_NODEFILE (/x)"));
        assert!(m.contains("$PBS_NODEFILE (/x) line 2"), "{m}");
        assert!(m.contains("one host per line"), "{m}");
        let m = err(parse_slot_lines("\n\n", "$PBS_NODEFILE (/x)"));
        assert!(m.contains("lists no hosts"), "{m}");
        let m = err(parse_slot_lines("n1\n-oProxy\n", "$PBS_NODEFILE (/x)"));
        assert!(m.contains("line 2") && m.contains("starts with '-'"), "{m}");
    }

    #[test]
    fn lsf_node_lists() {
        // `bsub -n 8 -R "span[ptile=4]"`: LSB_DJOB_HOSTFILE, one line per slot.
        let file = "hostA\nhostA\nhostA\nhostA\nhostB\nhostB\nhostB\nhostB\n";
        let want = vec![host("hostA", Some(4)), host("hostB", Some(4))];
        assert_eq!(parse_slot_lines(file, "LSB_DJOB_HOSTFILE").unwrap(), want);
        // The same job's LSB_MCPU_HOSTS (LSF ends it with a space) and LSB_HOSTS.
        assert_eq!(parse_lsf_mcpu_hosts("hostA 4 hostB 4 ").unwrap(), want);
        assert_eq!(
            parse_lsb_hosts("hostA hostA hostA hostA hostB hostB hostB hostB").unwrap(),
            want
        );
        let m = err(parse_lsf_mcpu_hosts("hostA 4 hostB"));
        assert!(m.contains("without its slot count"), "{m}");
        let m = err(parse_lsf_mcpu_hosts("hostA four"));
        assert!(m.contains("$LSB_MCPU_HOSTS host \"hostA\""), "{m}");
        assert!(err(parse_lsb_hosts("  ")).contains("$LSB_HOSTS lists no hosts"));
    }

    #[test]
    fn sge_pe_hostfile() {
        // `qsub -pe mpi 8` over two hosts; one host in two queues counts once, slots added.
        let text = "node01.example.com 4 all.q@node01.example.com UNDEFINED\n\
                    node02.example.com 2 all.q@node02.example.com UNDEFINED\n\
                    node02.example.com 2 gpu.q@node02.example.com <NULL>\n";
        assert_eq!(
            parse_pe_hostfile(text, "PE_HOSTFILE").unwrap(),
            vec![
                host("node01.example.com", Some(4)),
                host("node02.example.com", Some(4)),
            ]
        );
        let m = err(parse_pe_hostfile(
            "n1 4 all.q@n1 UNDEFINED\nn2\n",
            "$PE_HOSTFILE (/p)",
        ));
        assert!(
            m.contains("$PE_HOSTFILE (/p) line 2") && m.contains("no slot count"),
            "{m}"
        );
        let m = err(parse_pe_hostfile(
            "n1 0 all.q@n1 UNDEFINED\n",
            "$PE_HOSTFILE (/p)",
        ));
        assert!(m.contains("line 1") && m.contains("is 0"), "{m}");
    }

    // ---- include / exclude ----

    fn cluster() -> Vec<Host> {
        vec![
            host("worker-0", Some(4)),
            host("worker-1", Some(4)),
            host("worker-2", None),
        ]
    }

    #[test]
    fn neither_include_nor_exclude_is_identity() {
        assert_eq!(
            apply_include_exclude(cluster(), None, None).unwrap(),
            cluster()
        );
    }

    #[test]
    fn include_and_exclude_together_rejected() {
        let m = err(apply_include_exclude(
            cluster(),
            Some("worker-0"),
            Some("worker-1"),
        ));
        assert!(
            m.contains("--include and --exclude exclude each other"),
            "{m}"
        );
    }

    #[test]
    fn include_whole_hosts_and_slots() {
        let h = apply_include_exclude(cluster(), Some("worker-2@worker-0:2,0"), None).unwrap();
        // Host-list order, not spec order; slots sorted.
        assert_eq!(names(&h), ["worker-0", "worker-2"]);
        assert_eq!(h[0].only_slots, Some(vec![0, 2]));
        assert_eq!(h[1].only_slots, None);
    }

    #[test]
    fn include_slots_of_host_with_unknown_count() {
        let h = apply_include_exclude(cluster(), Some("worker-2:5"), None).unwrap();
        assert_eq!(h[0].only_slots, Some(vec![5]));
    }

    #[test]
    fn include_slot_out_of_range() {
        let m = err(apply_include_exclude(cluster(), Some("worker-1:4"), None));
        assert!(m.contains("slot 4"), "{m}");
        assert!(m.contains("slots 0-3"), "{m}");
    }

    #[test]
    fn unknown_host_suggests_closest() {
        let m = err(apply_include_exclude(cluster(), Some("wroker-1"), None));
        assert!(m.contains("\"wroker-1\""), "{m}");
        assert!(m.contains("known: worker-0, worker-1, worker-2"), "{m}");
        assert!(m.contains("did you mean \"worker-1\"?"), "{m}");
        let m = err(apply_include_exclude(cluster(), None, Some("gpu-9")));
        assert!(m.contains("--exclude names host \"gpu-9\""), "{m}");
        assert!(!m.contains("did you mean"), "{m}");
    }

    #[test]
    fn unknown_host_list_is_shortened() {
        let hosts: Vec<Host> = (0..20).map(|i| host(&format!("n{i}"), None)).collect();
        let m = err(apply_include_exclude(hosts, Some("zzzzzz"), None));
        assert!(m.contains("and 12 more"), "{m}");
        let m = err(apply_include_exclude(Vec::new(), Some("a"), None));
        assert!(m.contains("host list is empty"), "{m}");
    }

    #[test]
    fn exclude_whole_hosts() {
        let h = apply_include_exclude(cluster(), None, Some("worker-1@worker-2")).unwrap();
        assert_eq!(h, vec![host("worker-0", Some(4))]);
    }

    #[test]
    fn exclude_slots_keeps_the_rest() {
        let h = apply_include_exclude(cluster(), None, Some("worker-1:0,2")).unwrap();
        assert_eq!(names(&h), ["worker-0", "worker-1", "worker-2"]);
        assert_eq!(h[1].only_slots, Some(vec![1, 3]));
        assert_eq!(h[0].only_slots, None);
    }

    #[test]
    fn exclude_every_slot_drops_the_host() {
        let h = apply_include_exclude(cluster(), None, Some("worker-0:0,1,2,3")).unwrap();
        assert_eq!(names(&h), ["worker-1", "worker-2"]);
    }

    #[test]
    fn exclude_slots_needs_the_slot_count() {
        let m = err(apply_include_exclude(cluster(), None, Some("worker-2:1")));
        assert!(m.contains("slot count is unknown"), "{m}");
        assert!(m.contains("worker-2"), "{m}");
    }

    #[test]
    fn exclude_respects_earlier_only_slots() {
        let mut hosts = cluster();
        hosts[2].only_slots = Some(vec![1, 5]);
        let h = apply_include_exclude(hosts, None, Some("worker-2:5")).unwrap();
        assert_eq!(h[2].only_slots, Some(vec![1]));
    }

    #[test]
    fn exclude_everything_rejected() {
        let m = err(apply_include_exclude(
            cluster(),
            None,
            Some("worker-0@worker-1@worker-2"),
        ));
        assert!(m.contains("leaves no hosts"), "{m}");
    }

    #[test]
    fn include_exclude_malformed_specs() {
        for (inc, exc, needle) in [
            (Some(""), None, "empty"),
            (None, Some("  "), "empty"),
            (Some("worker-0@"), None, "empty host"),
            (Some("@worker-0"), None, "empty host"),
            (Some("worker-0@@worker-1"), None, "empty host"),
            (Some("worker-0:"), None, "empty slot"),
            (Some("worker-0:1,,2"), None, "empty slot"),
            (Some("worker-0:x"), None, "not a slot number"),
            (Some("worker-0:-1"), None, "not a slot number"),
            (Some("worker-0:1,1"), None, "slot 1 twice"),
            (Some("worker-0@worker-0:1"), None, "twice"),
            (None, Some("worker-0:9"), "slot 9"),
            (None, Some("worker-0:1:2"), "more than one ':'"),
        ] {
            let m = err(apply_include_exclude(cluster(), inc, exc));
            assert!(m.contains(needle), "{inc:?} {exc:?}: {m}");
        }
    }

    #[test]
    fn include_ipv6_host() {
        let hosts = parse_hosts_flag("[fe80::1]:4,b").unwrap();
        let h = apply_include_exclude(hosts, Some("[fe80::1]:1,3"), None).unwrap();
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].only_slots, Some(vec![1, 3]));
    }

    // ---- --nnodes ----

    #[test]
    fn nnodes_takes_the_first() {
        let h = take_nnodes(cluster(), 2).unwrap();
        assert_eq!(names(&h), ["worker-0", "worker-1"]);
        assert_eq!(take_nnodes(cluster(), 3).unwrap(), cluster());
    }

    #[test]
    fn nnodes_too_many() {
        let hosts = vec![host("a", None), host("b", None), host("c", None)];
        assert_eq!(
            err(take_nnodes(hosts, 4)),
            "--nnodes 4 but the host list has 3 hosts: a, b, c; give more hosts or a smaller --nnodes"
        );
        assert!(err(take_nnodes(vec![host("a", None)], 2)).contains("has 1 host: a;"));
        assert!(err(take_nnodes(Vec::new(), 1)).contains("has no hosts"));
        assert!(err(take_nnodes(cluster(), 0)).contains("at least 1"));
    }

    // ---- rank layout ----

    #[test]
    fn layout_contiguous_per_node() {
        let hosts = vec![host("a", Some(2)), host("b", None), host("c", Some(8))];
        let l = rank_layout(&hosts, 2).unwrap();
        assert_eq!(
            l,
            vec![
                vec![(0, 0, 0), (1, 1, 1)],
                vec![(2, 0, 0), (3, 1, 1)],
                vec![(4, 0, 0), (5, 1, 1)],
            ]
        );
    }

    #[test]
    fn layout_slot_limit() {
        let hosts = vec![host("a", Some(8)), host("b", Some(4))];
        assert_eq!(
            err(rank_layout(&hosts, 8)),
            "host b has 4 slots but --nproc-per-node 8 asks for 8 workers; \
             lower --nproc-per-node or raise the host's slot count"
        );
        assert!(rank_layout(&hosts, 4).is_ok());
        assert!(err(rank_layout(&[host("a", Some(1))], 2)).contains("has 1 slot but"));
    }

    #[test]
    fn layout_only_slots() {
        let mut hosts = vec![host("a", Some(4)), host("b", Some(4)), host("c", None)];
        hosts[0].only_slots = Some(vec![3, 1]);
        hosts[2].only_slots = Some(vec![6]);
        // only_slots overrides nproc, even one larger than the slot count.
        let l = rank_layout(&hosts, 4).unwrap();
        assert_eq!(
            l,
            vec![
                vec![(0, 0, 1), (1, 1, 3)],
                vec![(2, 0, 0), (3, 1, 1), (4, 2, 2), (5, 3, 3)],
                vec![(6, 0, 6)],
            ]
        );
    }

    #[test]
    fn layout_after_include_and_exclude() {
        let hosts = apply_include_exclude(cluster(), None, Some("worker-0:1")).unwrap();
        let l = rank_layout(&hosts, 2).unwrap();
        assert_eq!(l[0], vec![(0, 0, 0), (1, 1, 2), (2, 2, 3)]);
        assert_eq!(l[1], vec![(3, 0, 0), (4, 1, 1)]);
        assert_eq!(l[2], vec![(5, 0, 0), (6, 1, 1)]);
    }

    #[test]
    fn layout_bad_inputs() {
        assert!(err(rank_layout(&[], 1)).contains("empty"));
        assert!(err(rank_layout(&cluster(), 0)).contains("at least 1"));
        assert!(err(rank_layout(&[host("a", None)], usize::MAX)).contains("more than"));
        let many: Vec<Host> = (0..3).map(|i| host(&format!("n{i}"), None)).collect();
        assert!(err(rank_layout(&many, MAX_WORKERS / 2)).contains("more than"));

        let mut h = host("a", Some(2));
        h.only_slots = Some(vec![]);
        assert!(err(rank_layout(&[h.clone()], 1)).contains("no slots"));
        h.only_slots = Some(vec![1, 1]);
        assert!(err(rank_layout(&[h.clone()], 1)).contains("twice"));
        h.only_slots = Some(vec![2]);
        assert!(err(rank_layout(&[h], 1)).contains("slot 2"));
    }

    #[test]
    fn edit_distance_basics() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("abc", ""), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("worker-1", "wroker-1"), 2);
        assert_eq!(edit_distance("nöde", "node"), 1);
    }

    // ---- robustness ----

    /// Deterministic xorshift, so a failure reproduces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn random_input_never_panics() {
        const ALPHABET: &[char] = &[
            'a', 'b', 'n', '0', '1', '9', '0', '-', ',', ':', '[', ']', '@', '#', '=', ' ', '\n',
            '\t', '\r', '.', '%', 'é', '字', 's', 'l', 'o', 't', '_', '\0',
        ];
        const PIECES: &[&str] = &[
            "slots=",
            "max_slots=",
            "[1-3]",
            "99999999999999999999",
            "::",
        ];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let base = vec![host("a", Some(2)), host("b", None), host("n1", Some(3))];
        for _ in 0..20_000 {
            let len = rng.below(24);
            let mut s = String::new();
            for _ in 0..len {
                if rng.below(8) == 0 {
                    s.push_str(PIECES[rng.below(PIECES.len())]);
                } else {
                    s.push(ALPHABET[rng.below(ALPHABET.len())]);
                }
            }
            let _ = parse_hosts_flag(&s);
            // filter_hostfile accepts exactly what parse_hostfile does, and keeping every host
            // gives a file that parses the same.
            match (
                parse_hostfile(&s, "fuzz"),
                filter_hostfile(&s, "fuzz", &|_| true),
            ) {
                (Ok(hosts), Ok(kept)) => {
                    assert_eq!(parse_hostfile(&kept, "fuzz").unwrap(), hosts, "{s:?}");
                }
                (Err(a), Err(b)) => assert_eq!(a.message, b.message, "{s:?}"),
                (a, b) => panic!("{s:?}: {a:?} vs {b:?}"),
            }
            let _ = expand_slurm_hostlist(&s);
            // Schedulers' lists: never a panic, and every host within its bounds.
            for hosts in [
                parse_slot_lines(&s, "f"),
                parse_pe_hostfile(&s, "f"),
                parse_lsf_mcpu_hosts(&s),
                parse_lsb_hosts(&s),
            ]
            .into_iter()
            .flatten()
            {
                assert!(!hosts.is_empty(), "{s:?}");
                assert!(
                    hosts
                        .iter()
                        .all(|h| h.slots.is_some_and(|n| (1..=MAX_SLOTS).contains(&n)))
                );
            }
            let _ = apply_include_exclude(base.clone(), Some(&s), None);
            let _ = apply_include_exclude(base.clone(), None, Some(&s));
            if let Ok(hosts) = parse_hosts_flag(&s) {
                let _ = rank_layout(&hosts, rng.below(4));
                let _ = take_nnodes(hosts, rng.below(4));
            }
            if let Ok(hosts) = apply_include_exclude(base.clone(), Some(&s), None) {
                let _ = rank_layout(&hosts, rng.below(4));
            }
            if let Ok(hosts) = apply_include_exclude(base.clone(), None, Some(&s)) {
                let _ = rank_layout(&hosts, rng.below(4));
            }
        }
    }

    #[test]
    fn parsed_names_reparse_to_themselves() {
        // Whatever -H accepts, a hostfile accepts too, with the same result.
        let mut rng = Rng(42);
        const ALPHABET: &[char] = &['a', 'z', '0', '9', '-', '.', '_', '@', ':', '[', ']'];
        for _ in 0..5_000 {
            let len = 1 + rng.below(10);
            let s: String = (0..len)
                .map(|_| ALPHABET[rng.below(ALPHABET.len())])
                .collect();
            if let Ok(from_flag) = parse_hosts_flag(&s) {
                let from_file = parse_hostfile(&s, "hf").unwrap();
                assert_eq!(from_flag, from_file, "{s:?}");
            }
        }
    }
}
