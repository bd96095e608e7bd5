"""Every TCPStore operation, through real torch.distributed.TCPStore clients.

Run as a worker under nrun (`nrun --nproc 1 tests/python/store_compat.py`), it talks to nrun's
store at MASTER_ADDR:MASTER_PORT. Run with `--reference` it hosts PyTorch's own server instead
(`--reference legacy` for the non-libuv backend), which checks that the expectations below are
PyTorch's behaviour, not ours. Prints one line per check and exits non-zero if any failed.
"""

import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

T = datetime.timedelta


def connect(host, port, timeout=10.0):
    return dist.TCPStore(host, port, is_master=False, timeout=T(seconds=timeout))


def main():
    if "--reference" in sys.argv:
        legacy = sys.argv[-1] == "legacy"
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=T(seconds=10), use_libuv=not legacy)
        host, port = "127.0.0.1", server.port
    else:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    s = connect(host, port)
    other = connect(host, port)
    results = []

    def check(name, fn):
        try:
            fn()
            results.append((name, None))
            print(f"ok   {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            results.append((name, e))
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)

    def set_get():
        s.set("k", "v")
        assert s.get("k") == b"v"
        s.set("k", b"\x00\xff binary")
        assert other.get("k") == b"\x00\xff binary"

    def wait_timeout_then_cancel():
        s.set_timeout(T(milliseconds=300))
        t0 = time.monotonic()
        try:
            s.get("never-set")
            raise AssertionError("get of a missing key returned")
        except (dist.DistStoreError, RuntimeError) as e:
            assert "timeout" in str(e).lower() or "timed out" in str(e).lower(), e
        assert time.monotonic() - t0 < 60  # a hang guard: it timed out, however loaded the machine
        # The connection is still in step after the client's CANCEL_WAIT.
        s.set_timeout(T(seconds=10))
        s.set("after-cancel", "1")
        assert s.get("after-cancel") == b"1"

    def wait_pushed_later():
        b_sent = threading.Event()

        def later():
            time.sleep(0.3)
            other.set("late-a", "1")
            time.sleep(0.1)
            b_sent.set()
            other.set("late-b", "2")
        th = threading.Thread(target=later)
        th.start()
        s.wait(["late-a", "late-b"])
        # Woken by the last key, not the first: an event, not a time that load can stretch.
        assert b_sent.is_set()
        th.join()
        assert s.get("late-b") == b"2"

    def wait_timeout_raises():
        try:
            s.wait(["nope-1", "nope-2"], T(milliseconds=200))
            raise AssertionError("wait on missing keys returned")
        except (dist.DistStoreError, RuntimeError):
            pass
        s.set("x-after-wait", "y")
        assert s.get("x-after-wait") == b"y"

    def compare_set():
        # Missing key, empty expected: stores desired and returns it.
        assert s.compare_set("cs1", "", "first") == b"first"
        assert s.get("cs1") == b"first"
        # Missing key, non-empty expected: returns expected, stores nothing.
        assert s.compare_set("cs2", "exp", "des") == b"exp"
        assert not s.check(["cs2"])
        # Present and equal: replaced.
        assert s.compare_set("cs1", "first", "second") == b"second"
        # Present and different: unchanged, returns current.
        assert s.compare_set("cs1", "wrong", "third") == b"second"
        assert s.get("cs1") == b"second"

    def add():
        assert s.add("ctr-missing", 5) == 5
        assert other.add("ctr-missing", -2) == 3
        assert s.get("ctr-missing") == b"3"

    def append():
        s.append("ap", "ab")
        s.append("ap", "cd")
        assert s.get("ap") == b"abcd"

    def multi():
        s.multi_set(["m1", "m2", "m3"], ["a", "b", b"\x00"])
        assert s.multi_get(["m3", "m1", "m2"]) == [b"\x00", b"a", b"b"]

    def delete_and_num_keys():
        before = s.num_keys()
        s.set("del-me", "1")
        assert s.num_keys() == before + 1
        assert s.delete_key("del-me") is True
        assert s.delete_key("del-me") is False
        assert s.num_keys() == before

    def check_op():
        assert not s.check(["chk"])
        s.set("chk", "1")
        assert s.check(["chk"])
        assert not s.check(["chk", "chk-missing"])

    def queues():
        assert s.queue_len("q") == 0
        s.queue_push("q", "one")
        s.queue_push("q", b"two")
        assert s.queue_len("q") == 2
        assert s.check(["q"])
        assert s.queue_pop("q") == b"one"
        assert other.queue_pop("q", False) == b"two"
        try:
            s.queue_pop("q", False)
            raise AssertionError("pop of an empty queue returned")
        except Exception as e:  # QueueEmptyError where torch has it
            assert "empty" in str(e).lower() or type(e).__name__ == "QueueEmptyError", e

    def queue_blocking_pop():
        def later():
            time.sleep(0.2)
            other.queue_push("bq", "item")
        th = threading.Thread(target=later)
        th.start()
        assert s.queue_pop("bq") == b"item"
        th.join()

    def list_keys():
        s.set("lk-a", "1")
        keys = s.list_keys()
        assert "lk-a" in keys and "k" in keys, keys

    def barrier():
        errs = []

        def part():
            try:
                c = connect(host, port)
                c.barrier("bar", 3, T(seconds=10))
            except Exception as e:  # noqa: BLE001
                errs.append(e)
        ths = [threading.Thread(target=part) for _ in range(3)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        assert not errs, errs

    check("set/get", set_get)
    check("get of a missing key times out, then cancel", wait_timeout_then_cancel)
    check("wait answered later", wait_pushed_later)
    check("wait timeout", wait_timeout_raises)
    check("compare_set", compare_set)
    check("add", add)
    check("append", append)
    check("multi_get/multi_set", multi)
    check("delete_key/num_keys", delete_and_num_keys)
    check("check", check_op)
    if hasattr(s, "queue_push"):
        check("queue push/pop/len", queues)
        check("queue blocking pop", queue_blocking_pop)
    if hasattr(s, "list_keys"):
        check("list_keys", list_keys)
    if hasattr(s, "barrier"):
        check("barrier", barrier)
    failed = [n for n, e in results if e is not None]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
