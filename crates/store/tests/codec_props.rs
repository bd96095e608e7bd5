//! Property tests of the TCPStore codec: arbitrary bytes never panic, what is parsed re-encodes
//! to the same bytes, and "need more" never asks for more than the limits allow.

use nrun_store::protocol::{MAX_REQUEST_LEN, Parsed, Request};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        match Request::parse(&bytes) {
            Ok(Parsed::Complete(req, used)) => {
                prop_assert!(used <= bytes.len());
                let mut again = Vec::new();
                req.encode(&mut again);
                prop_assert_eq!(&again[..], &bytes[..used]);
            }
            Ok(Parsed::Incomplete { need }) => {
                prop_assert!(need > bytes.len());
                prop_assert!(need <= MAX_REQUEST_LEN);
            }
            Err(_) => {}
        }
    }

    /// Structured inputs: a valid opcode followed by small length fields, so parsing gets deep.
    #[test]
    fn near_valid_requests_never_panic(
        op in 0u8..20,
        fields in proptest::collection::vec((0u64..40, proptest::collection::vec(any::<u8>(), 0..40)), 0..6),
    ) {
        let mut bytes = vec![op];
        for (len, data) in fields {
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(&data);
        }
        for cut in 0..=bytes.len() {
            let _ = Request::parse(&bytes[..cut]);
        }
    }
}
