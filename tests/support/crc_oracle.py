"""The CRC-32C oracle the codec, proto and log tests check against: a plain table-driven
Castagnoli CRC (reflected, init and xorout 0xFFFFFFFF), written from the definition and
independent of the `crc32c` package the code uses. (tests/ is not a package: import it as
`from crc_oracle import crc32c_oracle`.)"""

from __future__ import annotations


def _table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c_oracle(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data`; `crc` continues a previous value."""
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c = _TABLE[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
