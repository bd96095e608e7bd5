//! One function per TCPStore verb, over the store's state with its lock held.
//!
//! Each takes what the request carried and appends its reply (if the verb has one) to `out`;
//! an `Err` closes the asking connection with that message. Who may ask (VALIDATE first, nrun's
//! secret for its own keys) and whether a write fits (--store-max-bytes) is decided before, in
//! `Store::apply_request`, so every verb here sees a request it must serve.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Conn, ENTRY_COST, ITEM_COST, Parked, Queue, Refusal, State, Value, is_control};
use crate::protocol::{
    CHECK_NOT_READY, CHECK_READY, MAX_VALUE_LEN, Request, STOP_WAITING, VALIDATE_MAGIC,
    WAIT_CANCELED, put_bytes, put_i64,
};

/// The most bytes `req`'s reply can take, from the state as it is (under the same lock that
/// then serves it): what the memory budget is asked for before the reply is built.
pub(super) fn reply_size(s: &State, req: &Request, hide: bool) -> usize {
    let value = |k: &[u8]| 8 + s.kv.get(k).map_or(0, |v| v.bytes.len());
    match req {
        Request::Get { key } => value(key),
        Request::MultiGet { keys } => keys
            .iter()
            .map(|k| value(k))
            .fold(0usize, usize::saturating_add),
        Request::CompareSet {
            key,
            expected,
            desired,
        } => 8 + expected.len().max(desired.len()).max(value(key)),
        Request::QueuePop { key } => {
            16 + s
                .queues
                .get(key)
                .and_then(|q| q.items.front())
                .map_or(0, |v| v.bytes.len())
        }
        Request::ListKeys => {
            8 + s
                .kv
                .keys()
                .filter(|k| !(hide && is_control(k)))
                .map(|k| 8 + k.len())
                .fold(0usize, usize::saturating_add)
        }
        // A counter, a flag, a nonce: a few bytes.
        _ => 8,
    }
}

/// VALIDATE again, once validated: only the magic is checked.
pub(super) fn validate(magic: u32) -> Result<(), Refusal> {
    if magic != VALIDATE_MAGIC {
        return Err(format!("VALIDATE with wrong magic {magic:#x}").into());
    }
    Ok(())
}

pub(super) fn set(s: &mut State, key: Vec<u8>, value: Vec<u8>, owner: IpAddr) {
    // Woken first, stored after: both under the state's lock, so no one sees the order.
    s.written(&key, false);
    s.put(key, value, owner);
}

/// Replies with the value the key holds afterwards: `desired` if it was swapped in, else the
/// current value (or `expected` when the key is missing and `expected` is not empty).
pub(super) fn compare_set(
    s: &mut State,
    key: Vec<u8>,
    expected: Vec<u8>,
    desired: Vec<u8>,
    owner: IpAddr,
    out: &mut Vec<u8>,
) {
    let reply = match s.kv.get(&key) {
        None if expected.is_empty() => {
            s.put(key.clone(), desired.clone(), owner);
            s.written(&key, false);
            desired
        }
        None => expected,
        Some(cur) if cur.bytes == expected => {
            s.put(key.clone(), desired.clone(), owner);
            s.written(&key, false);
            desired
        }
        Some(cur) => cur.bytes.clone(),
    };
    put_bytes(out, &reply);
}

pub(super) fn get(s: &State, key: &[u8], out: &mut Vec<u8>) {
    put_bytes(out, s.kv.get(key).map_or(&[][..], |v| &v.bytes));
}

pub(super) fn add(
    s: &mut State,
    key: &[u8],
    delta: i64,
    owner: IpAddr,
    out: &mut Vec<u8>,
) -> Result<(), Refusal> {
    put_i64(out, s.add(key, delta, owner)?);
    Ok(())
}

pub(super) fn check(s: &State, keys: &[Vec<u8>], out: &mut Vec<u8>) {
    let ready = keys.iter().all(|k| s.exists(k));
    out.push(if ready { CHECK_READY } else { CHECK_NOT_READY });
}

/// Answers at once when every key exists; else parks the connection until they all do (see
/// `State::written`), replacing any wait it had pending.
pub(super) fn wait(
    s: &mut State,
    c: &Conn,
    next_wait: &AtomicU64,
    mut keys: Vec<Vec<u8>>,
    budget: usize,
    out: &mut Vec<u8>,
) -> Result<(), Refusal> {
    keys.sort_unstable();
    keys.dedup();
    keys.retain(|k| !s.exists(k));
    if keys.is_empty() {
        out.push(STOP_WAITING);
        return Ok(());
    }
    let cost = wait_cost(&keys);
    let before = s.parked.get(&c.id).map_or(0, |p| p.cost);
    if s.waiting.saturating_sub(before).saturating_add(cost) > budget {
        return Err(format!(
            "a WAIT on {} missing keys ({cost} bytes) is past the store's budget for waits \
             ({budget} bytes, {} held)",
            keys.len(),
            s.waiting
        )
        .into());
    }
    let generation = next_wait.fetch_add(1, Ordering::Relaxed);
    for k in &keys {
        s.watchers
            .entry(k.clone())
            .or_default()
            .push((c.id, generation));
    }
    park(s, c, generation, keys, false);
    Ok(())
}

/// What a wait's keys cost while it is parked: each key is held twice (the wait's list and
/// the watchers' map), each with an entry's cost.
fn wait_cost(keys: &[Vec<u8>]) -> usize {
    keys.iter().map(|k| 2 * (ENTRY_COST + k.len())).sum()
}

/// Parks connection `c` until `keys` are all set (a WAIT) or the barrier fills: one wait per
/// connection, so an earlier one it left is forgotten.
fn park(s: &mut State, c: &Conn, generation: u64, keys: Vec<Vec<u8>>, barrier: bool) {
    s.forget_wait(c.id);
    c.live.parked.store(true, Ordering::Relaxed);
    let cost = wait_cost(&keys);
    s.waiting += cost;
    let parked = Parked {
        generation,
        remaining: if barrier { 1 } else { keys.len() },
        wake: c.wake.clone(),
        keys,
        barrier,
        cost,
    };
    s.parked.insert(c.id, parked);
}

/// Counted as LIST_KEYS lists them: with `hide`, nrun's own keys are left out.
pub(super) fn get_num_keys(s: &State, hide: bool, out: &mut Vec<u8>) {
    let n = s.kv.keys().filter(|k| !(hide && is_control(k))).count();
    put_i64(out, n as i64);
}

pub(super) fn delete_key(s: &mut State, key: &[u8], out: &mut Vec<u8>) {
    let removed = s.remove(key);
    put_i64(out, removed as i64);
}

/// The limit on a value applies to what APPEND makes of it: a value grown past what SET may
/// store is refused (the connection closed), and the value is left as it was. The grown value
/// is the appender's, as after a SET.
pub(super) fn append(
    s: &mut State,
    key: Vec<u8>,
    value: Vec<u8>,
    owner: IpAddr,
) -> Result<(), Refusal> {
    let had = s.kv.get(&key).map(|v| v.bytes.len());
    let grown = had.unwrap_or(0).saturating_add(value.len());
    if grown as u64 > MAX_VALUE_LEN {
        return Err(format!(
            "APPEND would grow key {} to {grown} bytes, past the limit on a value \
             ({MAX_VALUE_LEN} bytes, as for SET)",
            String::from_utf8_lossy(&key)
        )
        .into());
    }
    let (control, cost) = (is_control(&key), ENTRY_COST + key.len());
    match s.kv.get_mut(&key) {
        Some(v) => {
            let was = (v.owner, cost + v.bytes.len());
            v.bytes.extend_from_slice(&value);
            v.owner = owner;
            s.credit(control, was.0, was.1);
            s.charge(control, owner, cost + grown);
        }
        None => s.put(key.clone(), value, owner),
    }
    s.written(&key, false);
    Ok(())
}

/// Its size was counted against the memory budget before (see [`reply_size`]): one request
/// naming a large value many times costs that connection, not the store's memory.
pub(super) fn multi_get(s: &State, keys: &[Vec<u8>], out: &mut Vec<u8>) {
    for k in keys {
        put_bytes(out, s.kv.get(k).map_or(&[][..], |v| &v.bytes));
    }
}

pub(super) fn multi_set(s: &mut State, pairs: Vec<(Vec<u8>, Vec<u8>)>, owner: IpAddr) {
    for (k, v) in pairs {
        s.written(&k, false);
        s.put(k, v, owner);
    }
}

/// Answered whether or not a wait is pending.
pub(super) fn cancel_wait(s: &mut State, c: &Conn, out: &mut Vec<u8>) {
    // A STOP_WAITING already sent to this connection goes out first: the connection forgets
    // its wait and drains its wake channel before applying CANCEL_WAIT (ConnTask's
    // serve_buffered), so this forget finds nothing left there.
    s.forget_wait(c.id);
    out.push(WAIT_CANCELED);
}

pub(super) fn ping(nonce: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&nonce.to_le_bytes());
}

/// Wakes at most one blocked pop (a pushed item serves one reader). The item, and the key
/// of a new queue, count toward --store-max-bytes like any stored byte, in the pusher's share.
pub(super) fn queue_push(s: &mut State, key: Vec<u8>, value: Vec<u8>, owner: IpAddr) {
    let control = is_control(&key);
    if !s.queues.contains_key(&key) {
        s.charge(control, owner, ENTRY_COST + key.len());
        let q = Queue {
            owner,
            items: VecDeque::new(),
        };
        s.queues.insert(key.clone(), q);
    }
    s.charge(control, owner, ITEM_COST + value.len());
    if let Some(q) = s.queues.get_mut(&key) {
        q.items.push_back(Value {
            bytes: value,
            owner,
        });
    }
    s.written(&key, true);
}

/// Replies with the queue's length before the pop, then the item if there was one.
pub(super) fn queue_pop(s: &mut State, key: &[u8], out: &mut Vec<u8>) {
    let control = is_control(key);
    let q = s.queues.get_mut(key);
    let len = q.as_ref().map_or(0, |q| q.items.len());
    put_i64(out, len as i64);
    if let Some(item) = q.and_then(|q| q.items.pop_front()) {
        s.credit(control, item.owner, ITEM_COST + item.bytes.len());
        put_bytes(out, &item.bytes);
    }
    // An emptied queue is forgotten, and its key with it.
    if len == 1
        && let Some(q) = s.queues.remove(key)
    {
        s.credit(control, q.owner, ENTRY_COST + key.len());
    }
}

pub(super) fn queue_len(s: &State, key: &[u8], out: &mut Vec<u8>) {
    put_i64(out, s.queues.get(key).map_or(0, |q| q.items.len()) as i64);
}

/// With `hide`, nrun's own keys are not listed. Like MULTI_GET, its size was counted against
/// the memory budget before (a store of millions of keys: refused, not built).
pub(super) fn list_keys(s: &State, hide: bool, out: &mut Vec<u8>) {
    let keys: Vec<&Vec<u8>> = s.kv.keys().filter(|k| !(hide && is_control(k))).collect();
    put_i64(out, keys.len() as i64);
    for k in keys {
        put_bytes(out, k);
    }
}

/// Counts this arrival under `key`; the last of `world_size` releases every connection parked
/// on it, the others park until then.
pub(super) fn barrier(
    s: &mut State,
    c: &Conn,
    next_wait: &AtomicU64,
    key: Vec<u8>,
    world_size: i64,
    out: &mut Vec<u8>,
) -> Result<(), Refusal> {
    let arrived = s.add(&key, 1, c.owner)?;
    if arrived >= world_size {
        for (conn, generation) in s.barriers.remove(&key).unwrap_or_default() {
            if s.parked
                .get(&conn)
                .is_some_and(|p| p.generation == generation)
                && let Some(p) = s.unpark(conn)
            {
                let _ = p.wake.send(STOP_WAITING);
            }
        }
        out.push(STOP_WAITING);
        return Ok(());
    }
    let generation = next_wait.fetch_add(1, Ordering::Relaxed);
    s.barriers
        .entry(key.clone())
        .or_default()
        .push((c.id, generation));
    park(s, c, generation, vec![key], true);
    Ok(())
}
