//! bisect's judge: one rule over a matrix of what pairs of nodes did together.
//!
//! Every group that ran adds to the matrix: a group of two is a pair's run (good, slow, or
//! failed); a larger group that passed clears its nodes; a larger group of the net probe adds
//! each ring link between two nodes as that pair's run, and clears the nodes whose links in
//! and out were good. A pair is bad only if it was bad every time it ran (the best run is
//! kept: one slow figure on a busy host is not a slow link).
//!
//! The rule, for every bad pair {a, b}:
//! - a node that passed elsewhere (cleared) and a node that did not: the fault follows the
//!   node that did not. It is named alone once it is bad with two partners, or with one and
//!   no other partner is left to try: its link is slow or broken.
//! - both passed elsewhere: the pair is named (a link or pair problem), once it was bad twice.
//! - neither: each is tried with a partner it has not run with, one that passed first. Only
//!   when no such partner is left is the pair called "too few other good nodes to tell".
//!
//! A node is therefore never named for a pair it was in while its partner failed everywhere
//! else; and "too few" is said only after every pair that could tell was tried.

use std::collections::{BTreeMap, BTreeSet};

use super::NodeVerdict;

/// One run of a pair of nodes.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Run {
    Good,
    /// Ran, slow: the evidence ("the link from a to b carried ...").
    Slow(String),
    /// Failed: the evidence.
    Fails(String),
}

impl Run {
    fn bad(&self) -> bool {
        !matches!(self, Run::Good)
    }

    /// "slow (evidence)" / "fails (evidence)".
    fn said(&self) -> String {
        match self {
            Run::Good => "good".into(),
            Run::Slow(e) if e.is_empty() => "slow".into(),
            Run::Slow(e) => format!("slow ({e})"),
            Run::Fails(e) if e.is_empty() => "fails".into(),
            Run::Fails(e) => format!("fails ({e})"),
        }
    }
}

#[derive(Default, Debug)]
pub(super) struct Matrix {
    /// Every run of each pair, keyed (lower, higher) node.
    pairs: BTreeMap<(usize, usize), Vec<Run>>,
    /// Nodes that passed in a group of two or more (every link in and out of them good there).
    cleared: BTreeSet<usize>,
    /// Nodes of a group that failed or ran slow with no pair of it found bad: each is tried
    /// in pairs.
    suspects: BTreeSet<usize>,
}

fn key(a: usize, b: usize) -> (usize, usize) {
    (a.min(b), a.max(b))
}

/// What the matrix says of each node that is not good, once nothing is left to try.
#[derive(Debug, PartialEq)]
pub(super) struct Judged {
    pub node: usize,
    pub verdict: NodeVerdict,
    pub evidence: String,
}

impl Matrix {
    pub(super) fn record(&mut self, a: usize, b: usize, run: Run) {
        if run == Run::Good {
            self.clear(a);
            self.clear(b);
        }
        self.pairs.entry(key(a, b)).or_default().push(run);
    }

    /// Node `n` passed with others.
    pub(super) fn clear(&mut self, n: usize) {
        self.cleared.insert(n);
        self.suspects.remove(&n);
    }

    pub(super) fn suspect(&mut self, n: usize) {
        if !self.cleared.contains(&n) {
            self.suspects.insert(n);
        }
    }

    fn runs(&self, a: usize, b: usize) -> &[Run] {
        self.pairs.get(&key(a, b)).map_or(&[], Vec::as_slice)
    }

    /// The pair's best run: good if it ever passed, else its first slow run, else its failure.
    fn best(&self, a: usize, b: usize) -> Option<&Run> {
        let runs = self.runs(a, b);
        runs.iter()
            .find(|r| **r == Run::Good)
            .or_else(|| runs.iter().find(|r| matches!(r, Run::Slow(_))))
            .or_else(|| runs.first())
    }

    fn bad(&self, a: usize, b: usize) -> bool {
        self.best(a, b).is_some_and(Run::bad)
    }

    fn cleared(&self, n: usize) -> bool {
        self.cleared.contains(&n)
    }

    /// The nodes of `alive` that `n` was bad with.
    fn bad_partners(&self, n: usize, alive: &[usize]) -> Vec<usize> {
        alive
            .iter()
            .copied()
            .filter(|&m| m != n && self.bad(n, m))
            .collect()
    }

    /// Nodes `n` has not run with that could tell: not themselves already pinned (bad with a
    /// node that passed elsewhere). Those that passed elsewhere first.
    fn candidates(&self, n: usize, alive: &[usize]) -> Vec<usize> {
        let mut c: Vec<usize> = alive
            .iter()
            .copied()
            .filter(|&m| m != n && self.runs(n, m).is_empty())
            .filter(|&m| {
                self.cleared(m) || !self.bad_partners(m, alive).iter().any(|&p| self.cleared(p))
            })
            .collect();
        c.sort_by_key(|&m| !self.cleared(m));
        c
    }

    /// Whether `n` is named alone: it did not pass anywhere, it is bad with a node that did,
    /// and with a second node too, or no other partner is left to try.
    fn pinned(&self, n: usize, alive: &[usize]) -> bool {
        if self.cleared(n) {
            return false;
        }
        let bad = self.bad_partners(n, alive);
        bad.iter().any(|&m| self.cleared(m))
            && (bad.len() >= 2 || self.candidates(n, alive).is_empty())
    }

    /// Nodes not yet judged: not cleared, in a bad pair or a suspect group, not pinned.
    fn open(&self, alive: &[usize]) -> Vec<usize> {
        alive
            .iter()
            .copied()
            .filter(|&n| !self.cleared(n))
            .filter(|&n| self.suspects.contains(&n) || !self.bad_partners(n, alive).is_empty())
            .filter(|&n| !self.pinned(n, alive))
            .collect()
    }

    /// The next round's pairs (disjoint), or none when every bad pair is judged: each open
    /// node with a partner it has not run with (one that passed elsewhere first), then each
    /// bad pair of two nodes that passed elsewhere, once more if it ran only once.
    pub(super) fn next_round(&self, alive: &[usize]) -> Vec<[usize; 2]> {
        let mut used = BTreeSet::new();
        let mut out = Vec::new();
        for n in self.open(alive) {
            if used.contains(&n) {
                continue;
            }
            if let Some(m) = self
                .candidates(n, alive)
                .into_iter()
                .find(|m| !used.contains(m))
            {
                used.extend([n, m]);
                out.push([n, m]);
            }
        }
        for (&(a, b), runs) in &self.pairs {
            let both_alive = alive.contains(&a) && alive.contains(&b);
            if both_alive
                && runs.len() < 2
                && self.bad(a, b)
                && self.cleared(a)
                && self.cleared(b)
                && !used.contains(&a)
                && !used.contains(&b)
            {
                used.extend([a, b]);
                out.push([a, b]);
            }
        }
        out
    }

    /// The verdicts once [`Matrix::next_round`] has nothing left to try (`names`: each node's
    /// label). Nodes not listed are good.
    pub(super) fn judge(&self, alive: &[usize], names: &[String]) -> Vec<Judged> {
        let name = |i: usize| names.get(i).map_or("?", String::as_str);
        let list = |v: &[usize]| v.iter().map(|&i| name(i)).collect::<Vec<_>>().join(", ");
        let mut out = Vec::new();
        for &n in alive {
            let bad = self.bad_partners(n, alive);
            if bad.is_empty() {
                continue;
            }
            let run = |m: usize| self.best(n, m).cloned().unwrap_or(Run::Good);
            if self.pinned(n, alive) {
                let fails = bad.iter().any(|&m| matches!(run(m), Run::Fails(_)));
                let parts: Vec<String> = bad
                    .iter()
                    .map(|&m| format!("{} with {}", run(m).said(), name(m)))
                    .collect();
                let passed: Vec<usize> = bad.iter().copied().filter(|&m| self.cleared(m)).collect();
                out.push(Judged {
                    node: n,
                    verdict: if fails {
                        NodeVerdict::Bad
                    } else {
                        NodeVerdict::Slow
                    },
                    evidence: format!(
                        "{}; {} pass{} elsewhere, this node nowhere: its own link",
                        parts.join("; "),
                        list(&passed),
                        if passed.len() == 1 { "es" } else { "" }
                    ),
                });
                continue;
            }
            // A partner pinned alone explains the pair: this node stays good.
            let unexplained: Vec<usize> = bad
                .iter()
                .copied()
                .filter(|&m| !self.pinned(m, alive))
                .collect();
            let Some(&m) = unexplained.first() else {
                continue;
            };
            let evidence = match (self.cleared(n), self.cleared(m)) {
                (true, true) => {
                    let times = match self.runs(n, m).len() {
                        1 => "its one run".to_string(),
                        t => format!("all {t} runs"),
                    };
                    format!(
                        "{} only with {} ({times}; a link or pair problem); both pass with other \
                         nodes",
                        run(m).said(),
                        list(&unexplained),
                    )
                }
                _ => format!(
                    "{} together with {}; too few other good nodes to tell which (every pair \
                     that could tell was tried)",
                    run(m).said(),
                    list(&unexplained)
                ),
            };
            out.push(Judged {
                node: n,
                verdict: NodeVerdict::Link,
                evidence,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("h{i}")).collect()
    }

    fn slow() -> Run {
        Run::Slow("the link carried 0.002 GB/s".into())
    }

    /// Runs the matrix to its end: `truth(a, b)` says how a pair runs; returns the verdicts and
    /// the rounds it took.
    fn settle(
        m: &mut Matrix,
        alive: &[usize],
        truth: impl Fn(usize, usize) -> Run,
    ) -> (Vec<(usize, NodeVerdict)>, usize) {
        let mut rounds = 0;
        loop {
            let next = m.next_round(alive);
            if next.is_empty() {
                break;
            }
            rounds += 1;
            assert!(rounds < 40, "the matrix never settles: {m:?}");
            for [a, b] in next {
                m.record(a, b, truth(a, b));
            }
        }
        let names = names(alive.len().max(alive.iter().max().map_or(0, |x| x + 1)));
        (
            m.judge(alive, &names)
                .into_iter()
                .map(|j| (j.node, j.verdict))
                .collect(),
            rounds,
        )
    }

    /// Node `bad`'s link is slow: every pair with it is slow.
    fn shaped(bad: usize) -> impl Fn(usize, usize) -> Run {
        move |a, b| {
            if a == bad || b == bad {
                slow()
            } else {
                Run::Good
            }
        }
    }

    #[test]
    fn one_shaped_node_of_three_is_named_alone() {
        // The case: the ring of all three found the link from 2 to 0 slow, 1 passed.
        let mut m = Matrix::default();
        m.record(2, 0, slow());
        m.clear(1);
        let (v, rounds) = settle(&mut m, &[0, 1, 2], shaped(2));
        assert_eq!(v, vec![(2, NodeVerdict::Slow)]);
        // 0 with 1 (0 passes), then 2 with 1 (2 slow with both).
        assert_eq!(rounds, 2);
        let e = &m.judge(&[0, 1, 2], &names(3))[0].evidence;
        assert!(
            e.contains("with h0") && e.contains("with h1") && e.contains("h0, h1 pass elsewhere"),
            "{e}"
        );
    }

    #[test]
    fn one_shaped_node_is_named_alone_whatever_its_place() {
        for n in [3, 4, 8] {
            for bad in 0..n {
                let alive: Vec<usize> = (0..n).collect();
                let mut m = Matrix::default();
                // Stage 2: disjoint pairs (a leftover joins the last).
                for p in super::super::partition(&alive, 2) {
                    if p.len() == 2 {
                        m.record(p[0], p[1], shaped(bad)(p[0], p[1]));
                    } else {
                        p.iter().for_each(|&x| m.suspect(x));
                    }
                }
                let (v, _) = settle(&mut m, &alive, shaped(bad));
                assert_eq!(v, vec![(bad, NodeVerdict::Slow)], "{n} nodes, {bad} shaped");
            }
        }
    }

    #[test]
    fn a_slow_pair_with_no_common_node_names_the_pair() {
        let alive = [0, 1, 2, 3];
        let truth = |a, b| match key(a, b) {
            (1, 2) => slow(),
            _ => Run::Good,
        };
        let mut m = Matrix::default();
        m.record(0, 1, Run::Good);
        m.record(2, 3, Run::Good);
        m.record(1, 2, slow());
        let (v, rounds) = settle(&mut m, &alive, truth);
        assert_eq!(v, vec![(1, NodeVerdict::Link), (2, NodeVerdict::Link)]);
        assert_eq!(rounds, 1, "measured once more, no more");
        let j = m.judge(&alive, &names(4));
        assert!(j[0].evidence.contains("only with h2"), "{}", j[0].evidence);
    }

    #[test]
    fn a_pair_slow_once_on_a_busy_host_blames_nobody() {
        let mut m = Matrix::default();
        m.record(0, 1, slow());
        m.record(2, 3, Run::Good);
        let (v, _) = settle(&mut m, &[0, 1, 2, 3], |_, _| Run::Good);
        assert!(v.is_empty(), "{v:?}");
    }

    #[test]
    fn two_nodes_are_too_few_to_tell() {
        let mut m = Matrix::default();
        m.record(0, 1, slow());
        let (v, rounds) = settle(&mut m, &[0, 1], shaped(1));
        assert_eq!(rounds, 0);
        assert_eq!(v, vec![(0, NodeVerdict::Link), (1, NodeVerdict::Link)]);
        assert!(
            m.judge(&[0, 1], &names(2))[0]
                .evidence
                .contains("too few other good nodes to tell which"),
        );
    }

    #[test]
    fn a_failing_node_is_bad_and_its_partners_stay_good() {
        let fails = |a: usize, b: usize| match a == 3 || b == 3 {
            true => Run::Fails("rank 1 on h3: connection refused".into()),
            false => Run::Good,
        };
        let mut m = Matrix::default();
        for x in 0..6 {
            m.suspect(x);
        }
        let (v, _) = settle(&mut m, &[0, 1, 2, 3, 4, 5], fails);
        assert_eq!(v, vec![(3, NodeVerdict::Bad)]);
    }
}
