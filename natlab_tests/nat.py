"""The NAT kinds of the lab as nftables rulesets for a router namespace.

A router namespace has two interfaces: `wan` on the lab's internet bridge and `lan` towards its
member(s). Every kind masquerades LAN→WAN and drops unsolicited UDP that is addressed to the
router itself (notes-network.md: a router that lets such a packet in creates a conntrack entry
for its own address and port, and the kernel then remaps the member's next flow to another port).
What differs is the mapping and which unsolicited inbound packets reach the member:

| kind            | mapping (RFC 4787)               | filtering                         | Kafila class |
|-----------------|----------------------------------|-----------------------------------|--------------|
| permissive      | endpoint-independent (port kept) | endpoint-independent (full cone)  | permissive   |
| ordinary-apdf   | endpoint-independent (port kept) | address-and-port-dependent        | ordinary     |
| ordinary-adf    | endpoint-independent (port kept) | address-dependent                 | ordinary     |
| restrictive     | endpoint-dependent (random port) | address-and-port-dependent        | restrictive  |

`public` is a member with no router at all (an address on the internet bridge).

Full cone and address-dependent filtering rely on Linux masquerade keeping the member's source
port when it is free (one member per router): the router then DNATs an admitted inbound packet
to the member on the same port. The lab checks that assumption in its own tests.
"""

from __future__ import annotations

PERMISSIVE = "permissive"
ORDINARY_APDF = "ordinary-apdf"
ORDINARY_ADF = "ordinary-adf"
RESTRICTIVE = "restrictive"
PUBLIC = "public"

NAT_KINDS = (PERMISSIVE, ORDINARY_APDF, ORDINARY_ADF, RESTRICTIVE)
ALL_KINDS = NAT_KINDS + (PUBLIC,)

# The class `kafila netcheck` should report for each kind. With one rendezvous IP (two ports) an
# address-dependent filter cannot be told from an endpoint-independent one (RFC 5780 §4.4 needs a
# second IP for that), so ordinary-adf may honestly read as permissive.
EXPECTED_CLASS = {
    PERMISSIVE: {"permissive"},
    ORDINARY_APDF: {"ordinary"},
    ORDINARY_ADF: {"ordinary", "permissive"},
    RESTRICTIVE: {"restrictive"},
    PUBLIC: {"permissive"},
}

# How long an address-dependent router remembers a contacted (address, mapped port): as long as
# conntrack keeps an assured UDP flow.
CONTACTED_TIMEOUT_S = 120


_CONTACTED_SET = (
    "set contacted { type ipv4_addr . inet_service; flags dynamic,timeout; "
    f"timeout {CONTACTED_TIMEOUT_S}s; }}"
)


def _common(masquerade: str, extra_pre: str = "", extra_fwd: str = "", extra_post: str = "") -> str:
    return f"""
table ip natlab {{
  {extra_post and _CONTACTED_SET}
  chain pre {{
    type nat hook prerouting priority dstnat; policy accept;
    {extra_pre}
  }}
  chain post {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" {masquerade}
  }}
  chain post_filter {{
    type filter hook postrouting priority 110; policy accept;
    {extra_post}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" meta l4proto icmp accept
    iifname "wan" counter name unsolicited_in drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "wan" ct state established,related accept
    {extra_fwd}
    iifname "wan" counter name unsolicited_fwd drop
  }}
  counter unsolicited_in {{ }}
  counter unsolicited_fwd {{ }}
  counter admitted {{ }}
}}
"""


def ruleset(kind: str, member_ip: str) -> str:
    """The nft script that turns a router namespace into a NAT of `kind` for `member_ip`."""
    if kind == PERMISSIVE:
        return _common(
            "masquerade",
            extra_pre=f'iifname "wan" meta l4proto udp counter name admitted dnat to {member_ip}',
            extra_fwd='iifname "wan" ct status dnat accept',
        )
    if kind == ORDINARY_APDF:
        return _common("masquerade")
    if kind == ORDINARY_ADF:
        # After masquerade (priority 110 > srcnat) the packet carries the mapped source port:
        # remember (remote address, mapped port); admit inbound UDP from any port of that address
        # to that mapped port.
        return _common(
            "masquerade",
            extra_pre=(
                'iifname "wan" ip saddr . udp dport @contacted counter name admitted '
                f"dnat to {member_ip}"
            ),
            extra_fwd='iifname "wan" ct status dnat accept',
            extra_post='oifname "wan" meta l4proto udp update @contacted { ip daddr . udp sport }',
        )
    if kind == RESTRICTIVE:
        return _common("masquerade fully-random")
    raise ValueError(f"unknown NAT kind {kind!r}; expected one of {', '.join(NAT_KINDS)}")
