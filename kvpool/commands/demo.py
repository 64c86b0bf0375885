"""`kvpool demo paging`: block tables, sharing, copy-on-write and the memory breakdown, step by step."""

from __future__ import annotations

from kvpool.core.kv_manager import KVCacheManager

WORDS = ["Four", "score", "and", "seven", "years", "ago", "our", "fathers", "brought", "forth"]


def add_arguments(p) -> None:
    p.add_argument("what", nargs="?", default="paging", choices=["paging"], help="which demo")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=12)


def _show(kv: KVCacheManager, names: dict[int, str], title: str) -> None:
    print(f"\n== {title}")
    for sid, name in names.items():
        if sid in kv.seqs:
            seq = kv.seq(sid)
            table = " ".join(
                f"[{b}{'*' if kv.pool.blocks[b].ref_count > 1 else ''}]" for b in kv.block_table(sid)
            )
            print(f"  {name:<10} {seq.num_tokens:>2} tokens  blocks {table}")
    u = kv.usage()
    print(
        f"  memory: {u.used_blocks}/{u.total_blocks} blocks used, {u.token_slots} slots hold tokens, "
        f"{u.empty_slots} allocated but empty, {u.cached_blocks} cached (evictable), {u.free_blocks} free"
    )


def main(args) -> int:
    B = args.block_size
    kv = KVCacheManager(num_blocks=args.num_blocks, block_size=B)
    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
    prompt = [vocab[w] for w in WORDS[:7]]
    names = {0: "prompt A", 1: "sample A1", 2: "sample A2", 3: "request B"}
    print(f"KV pool: {args.num_blocks} blocks x {B} slots. '*' marks a block shared by several sequences.")
    kv.allocate(0, prompt)
    kv.commit(0, prompt, len(prompt))
    _show(kv, names, f"prefill '{' '.join(WORDS[:7])}' ({len(prompt)} tokens): ceil(7/{B}) blocks")
    kv.fork(0, 1)
    kv.fork(0, 2)
    _show(kv, names, "fork two more samples: every block shared, nothing copied")
    for sid in (0, 1, 2):
        copies = kv.append_slots(sid)
        what = f"copy-on-write block {copies[0][0]} -> {copies[0][1]}" if copies else "writes in place (last holder)"
        print(f"  {names[sid]} appends a token: {what}")
    _show(kv, names, "first decode step")
    for sid in (1, 2):
        kv.free(sid)
    _show(kv, names, "samples A1, A2 finish: their private blocks are freed")
    tokens = prompt + [vocab["fathers"]]
    kv.commit(0, tokens, len(tokens))
    kv.free(0)
    _show(kv, names, "A finishes: its full blocks stay cached by hash (refcount 0, evictable)")
    b_prompt = prompt + [vocab["fathers"], vocab["brought"], vocab["forth"]]
    cached = kv.allocate(3, b_prompt)
    _show(kv, names, f"request B shares A's prefix: {cached} of {len(b_prompt)} prompt tokens reused, not recomputed")
    st = kv.stats
    print(f"\nprefix cache: {st.hits_tokens}/{st.queries_tokens} prompt tokens hit ({st.hit_rate:.0%}); "
          f"copy-on-write copies: {kv.num_cow_copies}")
    return 0
