"""What a verified client certificate names (stalwart/security/identity.py `from_certificate`):
the dicts are `SSLSocket.getpeercert()`'s, as the controller's TLS layer hands them over."""
from stalwart.security.identity import Identity, Scope, from_certificate, from_request


def cert(cn: str = "host.example", *uris: str, dns: tuple[str, ...] = ()) -> dict:
    return {"subject": ((("organizationName", "example"),), (("commonName", cn),)),
            "subjectAltName": tuple(("URI", u) for u in uris) + tuple(("DNS", d) for d in dns)}


def test_a_spiffe_uri_names_a_machine_an_operator_or_a_reader():
    assert from_certificate(cert("x", "spiffe://prod.example/machine/node-17")) == \
        (Identity(Scope.AGENT, "node-17"), "")
    assert from_certificate(cert("x", "spiffe://prod.example/operator"))[0] == Identity(Scope.OPERATOR)
    assert from_certificate(cert("x", "spiffe://prod.example/reader"))[0] == Identity(Scope.READER)
    # other URIs of the certificate do not matter; the URI wins over the CN
    assert from_certificate(cert("stalwart:operator", "https://example.com/x",
                                 "spiffe://t/machine/m1"))[0] == Identity(Scope.AGENT, "m1")


def test_the_common_name_names_one_when_no_uri_does():
    assert from_certificate(cert("stalwart:machine:m2"))[0] == Identity(Scope.AGENT, "m2")
    assert from_certificate(cert("stalwart:operator"))[0] == Identity(Scope.OPERATOR)
    assert from_certificate(cert("stalwart:reader", dns=("r.example",)))[0] == Identity(Scope.READER)


def test_a_certificate_without_a_stalwart_name_proves_nothing():
    for c in (cert("127.0.0.1", dns=("controller.example",)),        # a server's certificate
              cert("m1"),                                             # a bare id is not a name
              cert("x", "spiffe://t/machine/bad id"),                 # not a machine id
              cert("x", "spiffe://t/machine/"), cert("x", "spiffe://t/machine/m1/extra"),
              cert("x", "spiffe://t/admin"), cert("x", "spiffe://t"),
              cert("stalwart:machine:m²"), cert("stalwart:join")):
        ident, why = from_certificate(c)
        assert ident is None and "no stalwart identity" in why, c
    assert from_certificate(None) == (None, "no client certificate")
    assert from_certificate({}) == (None, "no client certificate")


def test_a_certificate_naming_two_identities_is_refused():
    ident, why = from_certificate(cert("x", "spiffe://t/machine/m1", "spiffe://t/machine/m2"))
    assert ident is None and "more than one" in why
    ident, _ = from_certificate(cert("x", "spiffe://t/machine/m1", "spiffe://u/machine/m1"))
    assert ident == Identity(Scope.AGENT, "m1")                       # the same one twice is one


def test_a_token_when_sent_is_what_counts():
    secret, machine = b"s" * 32, cert("x", "spiffe://t/machine/m1")
    assert from_request(None, machine, "op", secret) == (Identity(Scope.AGENT, "m1"), "")
    assert from_request("Bearer op", machine, "op", secret) == (Identity(Scope.OPERATOR), "")
    assert from_request("Bearer wrong", machine, "op", secret) == (None, "wrong token")
    assert from_request(None, None, "op", secret) == (None, "no token")
    ident, why = from_request(None, cert("host"), "op", secret)
    assert ident is None and why == "no token, and the client certificate names no stalwart identity"
