"""A reader of R's XDR serialisation format (version 2/3) and lazy-load databases.

Enough for R data packages (Debian's ``r-cran-janeaustenr``): no R and no extra
Python package needed.
"""

from __future__ import annotations

import gzip
import struct
import zlib


class _RReader:
    """Minimal reader of R's XDR serialisation (``saveRDS``/lazy-load DB entries).

    Handles what R data packages hold: vectors (logical, integer, double,
    complex, character, list, raw), pairlists/attributes, symbols, environments
    and references. Values come back as plain Python: vectors as lists, with
    their attributes dropped except for a list's ``names`` (returned as dict).
    """

    _NIL = (254, 242, 241, 253, 251, 252, 250)

    def __init__(self, data: bytes):
        self.d, self.p, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.p = 2
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            n = self._int()  # length of the native encoding name that follows
            self.p += n

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def _len(self) -> int:
        n = self._int()
        if n == -1:  # long vector
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self):
        flags = self._int()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind in self._NIL:
            return None
        if kind == 255:  # reference to an earlier symbol/environment
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind in (247, 248, 249):  # persistent name / package / namespace
            self._int()
            val = [self.read() for _ in range(self._int())]
            self.refs.append(val)
            return val
        if kind == 1:  # symbol
            val = self.read()
            self.refs.append(val)
            return val
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like: read as [(tag, value)]
            items = []
            while True:
                if has_attr:
                    self.read()
                tag = self.read() if has_tag else None
                items.append((tag, self.read()))
                flags = self._int()
                kind = flags & 0xFF
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return items
                if kind != 2:  # improper tail
                    self.p -= 4
                    items.append((None, self.read()))
                    return items
        if kind == 4:  # environment
            self._int()
            env: dict = {}
            self.refs.append(env)
            env["enclos"], env["frame"], env["hashtab"], env["attr"] = (
                self.read(),
                self.read(),
                self.read(),
                self.read(),
            )
            return env
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None  # NA_character_
            raw = self.d[self.p : self.p + n]
            self.p += n
            return raw.decode("latin-1" if (flags >> 12) & 4 else "utf-8")
        if kind in (10, 13):
            n = self._len()
            val = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
        elif kind == 14:
            n = self._len()
            val = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
        elif kind == 15:
            n = self._len()
            val = list(struct.unpack_from(f">{2 * n}d", self.d, self.p))
            self.p += 16 * n
        elif kind in (16, 19, 20):
            val = [self.read() for _ in range(self._len())]
        elif kind == 24:
            n = self._len()
            val = self.d[self.p : self.p + n]
            self.p += n
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attrs = dict(self.read() or [])
            names = attrs.get("names")
            if kind == 19 and isinstance(names, list) and len(names) == len(val):
                return dict(zip(names, val, strict=True))
        return val


def r_unserialize(data: bytes):
    """Parse one R-serialised object (gzip/zlib already removed)."""
    return _RReader(data).read()


def read_r_lazyload(rdx: bytes, rdb: bytes) -> dict:
    """Objects of an R lazy-load database (``Rdata.rdx`` + ``Rdata.rdb``), by name.

    The .rdx is a serialised list ``variables -> name -> c(offset, length)``
    (gzip-wrapped); each .rdb entry is a 4-byte big-endian length and a zlib
    stream (R's default ``compress = TRUE``).
    """
    if rdx[:2] == b"\x1f\x8b":
        index = r_unserialize(gzip.decompress(rdx))
    else:
        index = r_unserialize(zlib.decompress(rdx[4:]))
    if index.get("compressed", [1])[0] not in (1, True):
        raise ValueError("only zlib-compressed lazy-load databases are supported")
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset : offset + length]
        out[name] = r_unserialize(zlib.decompress(blob[4:]))
    return out
