//! Proving the run's secret without sending it: the store gives each connection a fresh nonce
//! (GET `nrun/challenge`), the client answers with HMAC-SHA256(secret, nonce) (SET `nrun/auth`).
//! A sniffer sees a nonce and a proof good for that connection only. Values that start processes
//! (the agents' steps) are sealed: encrypted with ChaCha20-Poly1305 under a key derived from
//! the secret (HKDF), the tag covering their key and a nonce the agent chose when it joined (published
//! in its `Joined` record), so an injected step, or one replayed from an earlier run, is
//! refused by the agent, and a step's environment is not readable on the wire.
//!
//! The proof goes both ways: before proving the secret, a client that holds it (an agent, a
//! joining c10d node) sends a challenge of its own and the store answers with
//! [`prove_store`], a MAC under a label of its own, so a store's proof is never a client's
//! (a fake store cannot reflect a client's challenge back to it) and a store that does not
//! know the secret is refused before it can hand out a step.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use nrun_base::{hex, random_bytes, random_hex};

type HmacSha256 = Hmac<Sha256>;

/// The secret every node of a c10d or static launch shares, from its environment. nrun reads
/// it; the job's workers never see it (their environment goes without it, inherited or
/// given), and nrun's own ranks get the run's secret from their agent instead.
pub const SHARED_SECRET_VAR: &str = "NRUN_RDZV_SECRET";

fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok())
        .collect()
}

/// The MAC over `parts`, each prefixed by its length so that no two splits collide. (HMAC
/// takes a key of any length: the error case does not happen.)
fn mac(secret: &[u8], parts: &[&[u8]]) -> Option<HmacSha256> {
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret).ok()?;
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    Some(m)
}

/// `N` bytes of key for `label` from `secret` (HKDF-SHA256, RFC 5869; `salt` names the use,
/// `label` the instance: the two are kept apart, so no two uses collide).
fn hkdf<const N: usize>(salt: &[u8], secret: &[u8], label: &[u8]) -> [u8; N] {
    let mut k = [0u8; N];
    // N is at most 32 here, far below HKDF-SHA256's 8160 bytes: the error case does not happen.
    let _ = Hkdf::<Sha256>::new(Some(salt), secret).expand(label, &mut k);
    k
}

/// A run's secret derived from one shared by every node (`NRUN_RDZV_SECRET`) and the run id,
/// for nodes that start on their own and must agree without sending it. (Derived by HKDF since
/// this version: every node of a run must run the same nrun, as the agents already check.)
pub fn derive(shared: &[u8], run_id: &str) -> String {
    hex(&hkdf::<32>(b"nrun-rdzv", shared, run_id.as_bytes()))
}

/// Runs the ciphers' CPU feature checks once (cached for the process, and for every process
/// forked from it after: nrun's spawner, before it forks agents).
pub fn warm_up() {
    let sealed = seal(b"warm", b"up", b"", b"");
    let _ = open(b"warm", b"up", b"", &sealed);
}

/// A fresh challenge for a connection.
pub fn nonce() -> std::io::Result<Vec<u8>> {
    random_hex().map(String::into_bytes)
}

/// The proof of `secret` for challenge `nonce`.
pub fn prove(secret: &[u8], nonce: &[u8]) -> Vec<u8> {
    mac(secret, &[b"nrun-auth", nonce])
        .map(|m| hex(&m.finalize().into_bytes()).into_bytes())
        .unwrap_or_default()
}

/// Whether `proof` proves `secret` for `nonce` (compared in constant time).
pub fn verify(secret: &[u8], nonce: &[u8], proof: &[u8]) -> bool {
    let (Some(p), Some(m)) = (unhex(proof), mac(secret, &[b"nrun-auth", nonce])) else {
        return false;
    };
    m.verify_slice(&p).is_ok()
}

/// The store's proof of `secret` for a client's challenge `nonce` (labelled apart from
/// [`prove`]: neither proof stands for the other).
pub fn prove_store(secret: &[u8], nonce: &[u8]) -> Vec<u8> {
    mac(secret, &[b"nrun-store-proof", nonce])
        .map(|m| hex(&m.finalize().into_bytes()).into_bytes())
        .unwrap_or_default()
}

/// Whether the store's `proof` proves `secret` for the client's challenge `nonce`.
pub fn verify_store(secret: &[u8], nonce: &[u8], proof: &[u8]) -> bool {
    let (Some(p), Some(m)) = (unhex(proof), mac(secret, &[b"nrun-store-proof", nonce])) else {
        return false;
    };
    m.verify_slice(&p).is_ok()
}

/// The key steps are encrypted with: derived from the secret for this use alone (never a
/// proof's key, never a seal).
fn step_cipher(secret: &[u8]) -> Option<ChaCha20Poly1305> {
    let k = hkdf::<32>(b"nrun-step-key", secret, b"");
    Some(ChaCha20Poly1305::new(Key::from_slice(&k)))
}

/// What a seal authenticates beside the value: the key it is stored under and the node's
/// nonce, each length-prefixed.
fn associated(key: &[u8], bound: &[u8]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(key.len() + bound.len() + 32);
    for p in [&b"nrun-seal"[..], key, bound] {
        aad.extend_from_slice(&(p.len() as u64).to_le_bytes());
        aad.extend_from_slice(p);
    }
    aad
}

/// Length of a seal's random nonce (ChaCha20-Poly1305's 96 bits).
const SEAL_NONCE: usize = 12;

/// `value` stored under `key` for the node that chose `bound` when it joined (empty: a step
/// written before that node joined), sealed: encrypted with ChaCha20-Poly1305 under a key
/// derived from the secret (a fresh random nonce first, then the ciphertext and its tag). The
/// tag covers the key (run, node index, step number) and the node's choice as well, so a step
/// sealed for another run, node, step or join of that node opens nowhere else, and what a step
/// carries (its workers' environment: `-x HF_TOKEN=...`) never crosses the wire in clear.
/// Empty (which opens nowhere) only if the OS has no random bytes.
pub fn seal(secret: &[u8], key: &[u8], bound: &[u8], value: &[u8]) -> Vec<u8> {
    let mut nonce = [0u8; SEAL_NONCE];
    let (Ok(()), Some(cipher)) = (random_bytes(&mut nonce), step_cipher(secret)) else {
        return Vec::new();
    };
    let aad = associated(key, bound);
    let payload = Payload {
        msg: value,
        aad: &aad,
    };
    match cipher.encrypt(Nonce::from_slice(&nonce), payload) {
        Ok(sealed) => [&nonce[..], &sealed].concat(),
        Err(_) => Vec::new(),
    }
}

/// The value of a sealed `raw` under `key` for the node that chose `bound`, if it was sealed
/// with this secret for exactly that key and nonce and is intact.
pub fn open(secret: &[u8], key: &[u8], bound: &[u8], raw: &[u8]) -> Option<Vec<u8>> {
    if raw.len() < SEAL_NONCE {
        return None;
    }
    let (nonce, sealed) = raw.split_at(SEAL_NONCE);
    let aad = associated(key, bound);
    let payload = Payload {
        msg: sealed,
        aad: &aad,
    };
    step_cipher(secret)?
        .decrypt(Nonce::from_slice(nonce), payload)
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_and_seals() {
        let n = nonce().unwrap();
        assert_eq!(n.len(), 32);
        assert_ne!(n, nonce().unwrap());
        let p = prove(b"s3cret", &n);
        assert!(verify(b"s3cret", &n, &p));
        assert!(!verify(b"guess", &n, &p));
        assert!(
            !verify(b"s3cret", &nonce().unwrap(), &p),
            "a proof is good for its nonce only"
        );
        assert!(
            !verify(b"s3cret", &n, b"s3cret"),
            "the plain secret is no proof"
        );
        let sealed = seal(b"k", b"nrun/r/n0/step/3", b"n0nce", b"{\"End\":null}");
        assert_eq!(
            open(b"k", b"nrun/r/n0/step/3", b"n0nce", &sealed).as_deref(),
            Some(&b"{\"End\":null}"[..])
        );
        assert_eq!(
            open(b"k", b"nrun/r/n0/step/4", b"n0nce", &sealed),
            None,
            "replayed under another key"
        );
        assert_eq!(
            open(b"k", b"nrun/r/n0/step/3", b"another", &sealed),
            None,
            "replayed to a node that chose another nonce (another run, or a later join)"
        );
        assert_eq!(open(b"k", b"nrun/r/n0/step/3", b"", &sealed), None);
        assert_eq!(open(b"other", b"nrun/r/n0/step/3", b"n0nce", &sealed), None);
        let mut forged = sealed.clone();
        *forged.last_mut().unwrap() ^= 1;
        assert_eq!(open(b"k", b"nrun/r/n0/step/3", b"n0nce", &forged), None);
        assert_eq!(open(b"k", b"nrun/r/n0/step/3", b"n0nce", b""), None);
        assert_eq!(
            open(b"k", b"nrun/r/n0/step/3", b"n0nce", &sealed[..20]),
            None
        );
        // The store's proof: its own label, so it is never a client's proof (no reflection).
        let mine = nonce().unwrap();
        let answer = prove_store(b"s3cret", &mine);
        assert!(verify_store(b"s3cret", &mine, &answer));
        assert!(!verify_store(b"guess", &mine, &answer));
        assert!(!verify_store(b"s3cret", &nonce().unwrap(), &answer));
        assert!(!verify_store(b"s3cret", &mine, b""), "no proof");
        assert!(
            !verify_store(b"s3cret", &mine, &prove(b"s3cret", &mine)),
            "a client's proof reflected back is no store's proof"
        );
        assert!(!verify(b"s3cret", &mine, &answer));
    }

    /// Nodes that start on their own agree on a run's secret by HKDF-SHA256 (RFC 5869) of
    /// the shared one, the use as salt and the run id as info: pinned by a value computed
    /// apart (Python's hmac), so a change of derivation is seen (nodes of two derivations
    /// cannot join one run).
    #[test]
    fn the_run_secret_is_hkdf_of_the_shared_one() {
        assert_eq!(
            derive(b"s3cret", "slurm-42.0"),
            "a68d9357ef666d6b136e1d2094efa601883f31da1227657c460b3dff20d821fa"
        );
        assert_ne!(
            derive(b"s3cret", "slurm-42.1"),
            derive(b"s3cret", "slurm-42.0")
        );
        assert_ne!(
            derive(b"other", "slurm-42.0"),
            derive(b"s3cret", "slurm-42.0")
        );
        // The step key is not the derived secret, nor a proof's.
        let d = derive(b"s3cret", "");
        let step = hkdf::<32>(b"nrun-step-key", b"s3cret", b"");
        assert_ne!(hex(&step), d);
    }

    /// A step's contents (a token in its workers' environment) are not in its sealed bytes,
    /// in clear or hex, and two seals of one step differ (a fresh nonce each).
    #[test]
    fn sealed_steps_are_encrypted() {
        let token = "hf_SECRETtokenVALUE1234567890";
        let step =
            format!(r#"{{"Run":{{"workers":[{{"env":[["HF_TOKEN","{token}"]]}}],"grace_ms":1}}}}"#);
        let key = b"nrun/r/n1/step/2";
        let sealed = seal(b"s3cret", key, b"n0nce", step.as_bytes());
        let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        assert!(!has(&sealed, token.as_bytes()));
        assert!(!has(&sealed, hex(token.as_bytes()).as_bytes()));
        assert!(!has(&sealed, b"HF_TOKEN"));
        assert!(!has(&sealed, b"Run"));
        assert_eq!(sealed.len(), SEAL_NONCE + step.len() + 16);
        assert_ne!(sealed, seal(b"s3cret", key, b"n0nce", step.as_bytes()));
        assert_eq!(
            open(b"s3cret", key, b"n0nce", &sealed).as_deref(),
            Some(step.as_bytes())
        );
    }
}
