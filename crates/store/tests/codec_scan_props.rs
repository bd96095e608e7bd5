//! Property tests of the store's resumable framing (`FrameScan`): on any bytes, fed whole or in
//! pieces, it ends a request exactly where `Request::parse` does, asks for the same bytes, and
//! refuses the same input.

use nrun_store::protocol::{FrameScan, Parsed, Request, Scanned};
use proptest::prelude::*;

/// The scan of `bytes` fed in pieces ending at `cuts`, against one parse of each prefix.
fn agree(bytes: &[u8], cuts: &[usize]) -> Result<(), TestCaseError> {
    let mut scan = FrameScan::default();
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    ends.push(bytes.len());
    ends.sort_unstable();
    for end in ends {
        let prefix = &bytes[..end];
        let s = scan.scan(prefix);
        match (Request::parse(prefix), &s) {
            (Ok(Parsed::Complete(_, a)), Ok(Scanned::Complete(b))) => prop_assert_eq!(a, *b),
            (Ok(Parsed::Incomplete { need: a }), Ok(Scanned::Incomplete { need: b })) => {
                prop_assert_eq!(a, *b)
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b.clone()),
            (p, s) => prop_assert!(false, "prefix {}: parse {:?}, scan {:?}", end, p, s),
        }
        if !matches!(s, Ok(Scanned::Incomplete { .. })) {
            break;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn the_scan_agrees_with_parse_on_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        agree(&bytes, &cuts)?;
    }

    /// A valid opcode followed by small length fields, so the scan gets deep into lists.
    #[test]
    fn the_scan_agrees_with_parse_on_near_valid_requests(
        op in 0u8..20,
        fields in proptest::collection::vec((0u64..40, proptest::collection::vec(any::<u8>(), 0..40)), 0..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let mut bytes = vec![op];
        for (len, data) in fields {
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(&data);
        }
        agree(&bytes, &cuts)?;
    }
}
