"""Host-side page allocation for the paged KV cache, with prefix caching.

The device holds one pool of ``num_pages`` pages per layer; a sequence owns an ordered list
of page ids (its page table). Page 0 is reserved as a scratch page: padding rows and unused
page-table entries point at it, so stray writes land nowhere that matters.

Prefix caching: every *full* page is named by a hash chain over its tokens
(``hash(parent_hash, tokens)``), so equal prefixes map to equal pages. Full pages are
immutable and shared by reference count; new tokens always go to a sequence's own last
page, so sharing needs no copy. When a page's count drops to zero it stays cached and
becomes evictable, least recently used first; allocation takes free pages before evicting.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct

SCRATCH_PAGE = 0


def page_hash(parent: bytes, tokens) -> bytes:
    """Hash-chain name of a full page: depends on every token before it too."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))  # (64-bit: an image's tokens are named by its hash)
    return h.digest()


ROOT_HASH = b"jaxinfer-prefix-root"


def root_hash(salt: str | None) -> bytes:
    """The root of a sequence's hash chain: ``ROOT_HASH``, or for a sequence whose keys depend
    on more than its tokens (a LoRA adapter's) one of its own, so that its pages are never
    shared with another's."""
    if salt is None:
        return ROOT_HASH
    h = hashlib.blake2b(ROOT_HASH, digest_size=16)
    h.update(salt.encode())
    return h.digest()


def prefix_hashes(tokens, page_size: int, n: int, root: bytes = ROOT_HASH) -> list[bytes]:
    """Hash-chain names of the first ``n`` full pages of ``tokens`` (chain from ``root``)."""
    out, h = [], root
    for i in range(n):
        h = page_hash(h, tokens[i * page_size : (i + 1) * page_size])
        out.append(h)
    return out


@dataclasses.dataclass
class AllocatorStats:
    prefix_queries: int = 0  # full prompt pages looked up
    prefix_hits: int = 0  # of which found cached
    evictions: int = 0


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is scratch)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free = collections.deque(range(1, num_pages))  # never-cached free pages
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> hash, for cached pages
        self._page_of: dict[bytes, int] = {}  # hash -> page
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU order
        self.stats = AllocatorStats()

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    def refcount(self, page: int) -> int:
        return self._ref[page]

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """n fresh pages (refcount 1), or raise MemoryError leaving state unchanged."""
        if n > self.num_free:
            raise MemoryError(f"need {n} pages, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:  # evict the least recently used unreferenced cached page
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(p)]
                self.stats.evictions += 1
            self._ref[p] = 1
            out.append(p)
        return out

    def release(self, pages) -> None:
        """Drop one reference to each page (a sequence finished or was preempted)."""
        for p in pages:
            if p == SCRATCH_PAGE:
                continue
            if self._ref[p] <= 0:
                raise AssertionError(f"page {p} released more often than referenced")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None  # most recently used at the end
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------ prefix cache
    def lookup_prefix(self, tokens: list[int], root: bytes = ROOT_HASH) -> tuple[list[int], bytes]:
        """Cached pages covering the longest run of full pages of ``tokens``, each with a
        new reference, and the hash chain value after them.

        At least one token is always left uncached, so the caller has a token whose logits
        it computes."""
        pages, h = [], root
        if not self.prefix_caching:
            return pages, h
        ps = self.page_size
        for i in range((len(tokens) - 1) // ps):
            nh = page_hash(h, tokens[i * ps : (i + 1) * ps])
            self.stats.prefix_queries += 1
            p = self._page_of.get(nh)
            if p is None:
                break
            self.stats.prefix_hits += 1
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1
            pages.append(p)
            h = nh
        return pages, h

    def acquire_cached(self, hashes) -> list[int] | None:
        """The cached pages named ``hashes``, each with a new reference, or None (and no
        reference taken) unless every one of them is still cached."""
        if not self.prefix_caching or any(h not in self._page_of for h in hashes):
            return None
        pages = [self._page_of[h] for h in hashes]
        for p in pages:
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1
        return pages

    def register_full_page(self, page: int, parent: bytes, tokens) -> bytes:
        """Name a page that just became full; returns its hash (the next page's parent).

        If an identical page is already cached (two sequences computed the same prefix at
        once), this one stays private and is freed normally when released."""
        h = page_hash(parent, tokens)
        if self.prefix_caching and h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h
        return h

    def check_invariants(self) -> None:
        """Every page is exactly one of: scratch, free, evictable, referenced."""
        free, ev = set(self._free), set(self._evictable)
        assert not free & ev
        for p in range(1, self.num_pages):
            states = (p in free) + (p in ev) + (self._ref[p] > 0)
            assert states == 1, (p, p in free, p in ev, self._ref[p])
            if p in ev:
                assert p in self._hash_of
        assert set(self._page_of.values()) == set(self._hash_of)
