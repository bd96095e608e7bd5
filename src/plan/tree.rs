//! The launch tree's shape (`--tree-width`): which agent starts which node's agent (over ssh,
//! or beside it for the launch host's own machine's tree).
//! Pure, so the split is tested without a process.
//!
//! The launch host starts at most `width` agents of the nodes it may start through others; the
//! rest are split among those in contiguous, balanced blocks, and each block's first `width`
//! nodes are started by its head while the rest are split among them again (Open MPI's PRRTE
//! routes its daemons through a radix tree the same way). Width 32 covers 32 + 32 x 32 = 1,056
//! nodes in two levels and 33,824 in three. Nodes that must stay direct children of the
//! launch host (spares, so that a spare taking the place of a node lost with its subtree does
//! not hang off another node) are left to the caller, as is splitting this machine's nodes
//! from the others (each set makes a tree of its own).
//!
//! Contiguous blocks keep each inner agent's number below its subtree's: a failure report that
//! names the first lost node in node order names the inner agent, whose words list the rest.

use crate::protocol::Branch;

/// The branches the launch host starts itself, out of `nodes` (node index, label), in order.
/// Width 0 or 1, or no more nodes than `width`: every node is a leaf the launch host starts.
pub(crate) fn split(nodes: &[(usize, String)], width: usize) -> Vec<Branch> {
    split_among(nodes, width, false)
}

/// As [`split`], for nodes all on one machine: each level's rest goes to as few heads as can
/// hold it (at most `width` each below them), not to every head. Their handshakes share that
/// machine's CPUs anyway, and each inner agent costs a process and a spawner of its own:
/// 2,048 nodes at width 32 take 64 inner agents, where the balanced split takes 1,024 (992 of
/// them starting one node).
pub(crate) fn split_packed(nodes: &[(usize, String)], width: usize) -> Vec<Branch> {
    split_among(nodes, width, true)
}

fn split_among(nodes: &[(usize, String)], width: usize, packed: bool) -> Vec<Branch> {
    if width < 2 || nodes.len() <= width {
        return nodes.iter().map(leaf).collect();
    }
    let (heads, rest) = nodes.split_at(width);
    let takers = match packed {
        true => rest.len().div_ceil(width).clamp(1, width),
        false => width,
    };
    let (q, r) = (rest.len() / takers, rest.len() % takers);
    let mut at = 0;
    heads
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let n = match i < takers {
                true => q + usize::from(i < r),
                false => 0,
            };
            let block = &rest[at..at + n];
            at += n;
            Branch {
                node: h.0,
                label: h.1.clone(),
                children: split_among(block, width, packed),
                local: false,
            }
        })
        .collect()
}

/// How many of `n` nodes [`split`] leaves to the launch host.
pub(crate) fn roots(n: usize, width: usize) -> usize {
    match width {
        0 | 1 => n,
        w => n.min(w),
    }
}

fn leaf(n: &(usize, String)) -> Branch {
    Branch {
        node: n.0,
        label: n.1.clone(),
        children: Vec::new(),
        local: false,
    }
}

/// How many levels of agents the tree has (1: the launch host starts them all).
pub(crate) fn depth(roots: &[Branch]) -> usize {
    roots
        .iter()
        .map(|b| 1 + depth(&b.children))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<(usize, String)> {
        (0..n).map(|i| (i, format!("b{i}"))).collect()
    }

    /// Every node exactly once; no agent starts more than `width`.
    fn check(roots: &[Branch], n: usize, width: usize) {
        assert!(roots.len() <= width);
        let mut seen = Vec::new();
        let mut todo: Vec<&Branch> = roots.iter().collect();
        while let Some(b) = todo.pop() {
            assert!(
                b.children.len() <= width,
                "{} has {}",
                b.label,
                b.children.len()
            );
            assert_eq!(b.label, format!("b{}", b.node));
            // An inner agent's number is below its whole subtree's.
            assert!(b.below().iter().all(|c| c.node > b.node));
            seen.push(b.node);
            todo.extend(b.children.iter());
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..n).collect::<Vec<_>>());
    }

    /// The open-file check's count of the launch host's own starts is the split's.
    #[test]
    fn roots_counts_what_split_leaves_to_the_launch_host() {
        for w in [0, 1, 2, 3, 32] {
            for n in [0, 1, 2, 5, 32, 33, 400, 1100] {
                assert_eq!(
                    roots(n, w),
                    split(&nodes(n), w).len(),
                    "{n} nodes, width {w}"
                );
            }
        }
    }

    #[test]
    fn no_tree_up_to_the_width_or_without_one() {
        for (n, w) in [(5, 0), (5, 1), (32, 32), (3, 32), (0, 32)] {
            let roots = split(&nodes(n), w);
            assert_eq!(roots.len(), n);
            assert!(roots.iter().all(|b| b.children.is_empty()));
        }
    }

    #[test]
    fn the_split_is_balanced_and_as_shallow_as_the_width_allows() {
        let roots = split(&nodes(5), 2);
        // b0 starts b2 and b3, b1 starts b4.
        assert_eq!(roots.len(), 2);
        assert_eq!(
            roots[0].children.iter().map(|b| b.node).collect::<Vec<_>>(),
            [2, 3]
        );
        assert_eq!(
            roots[1].children.iter().map(|b| b.node).collect::<Vec<_>>(),
            [4]
        );
        assert_eq!(depth(&roots), 2);
        // 7 nodes, width 2: three levels (b0 -> b2 -> b4).
        let roots = split(&nodes(7), 2);
        assert_eq!(depth(&roots), 3);
        assert_eq!(roots[0].below().len(), 3);
        assert_eq!(roots[1].below().len(), 2);
        for (n, w, levels) in [
            (33, 32, 2),
            (1056, 32, 2),
            (1057, 32, 3),
            (16384, 32, 3),
            (33_824, 32, 3),
            (33_825, 32, 4),
            (100, 4, 4),
        ] {
            let roots = split(&nodes(n), w);
            check(&roots, n, w);
            assert_eq!(depth(&roots), levels, "{n} nodes, width {w}");
            assert_eq!(roots.len(), w);
            // Balanced: subtrees differ by at most one node.
            let sizes: Vec<usize> = roots.iter().map(|b| b.below().len()).collect();
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(hi - lo <= 1, "{n}/{w}: {sizes:?}");
        }
    }

    /// This machine's own tree: the same levels, every node once, no agent starting more than
    /// the width, and inner agents only where the nodes need them.
    #[test]
    fn a_packed_split_has_the_levels_of_the_balanced_one_and_few_inner_agents() {
        fn inner(bs: &[Branch]) -> usize {
            bs.iter()
                .filter(|b| !b.children.is_empty())
                .map(|b| 1 + inner(&b.children))
                .sum()
        }
        for (n, w, inner_agents) in [
            (32, 32, 0),
            (33, 32, 1),
            (1056, 32, 32),
            (2048, 32, 64),
            (16384, 32, 32 + 32 * 15),
            (100, 4, 4 + 16 + 16),
        ] {
            let packed = split_packed(&nodes(n), w);
            check(&packed, n, w);
            let balanced = split(&nodes(n), w);
            assert_eq!(depth(&packed), depth(&balanced), "{n} nodes, width {w}");
            assert_eq!(inner(&packed), inner_agents, "{n} nodes, width {w}");
            assert!(inner(&packed) <= inner(&balanced));
        }
        assert_eq!(inner(&split(&nodes(2048), 32)), 32 + 32 * 31);
    }

    /// The Hello that carries a subtree reads back the same, and an older Hello without one
    /// reads as no tree.
    #[test]
    fn a_subtree_survives_the_hello_round_trip() {
        let roots = split(&nodes(7), 2);
        let json = serde_json::to_string(&roots[0]).unwrap();
        let back: Branch = serde_json::from_str(&json).unwrap();
        assert_eq!(back, roots[0]);
        let leaf: Branch = serde_json::from_str(r#"{"node":3,"label":"b3"}"#).unwrap();
        assert!(leaf.children.is_empty());
    }
}
