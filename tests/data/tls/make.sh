#!/usr/bin/env bash
# Regenerates the TLS test certificates (tests/tls.rs): a CA, a server
# certificate it signs for localhost / 127.0.0.1, and an unrelated CA that a
# refused client trusts. Test material only: the keys are public. Valid for
# 100 years so the test never expires.
set -euo pipefail
cd "$(dirname "$0")"
days=36500
ec() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
ec ca.key
openssl req -x509 -new -key ca.key -sha256 -days $days -subj "/CN=kvferry test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem
ec server.key
openssl req -new -key server.key -subj "/CN=localhost" -out server.csr
printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
    "extendedKeyUsage=serverAuth" "subjectAltName=DNS:localhost,IP:127.0.0.1" >server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -sha256 -days $days \
    -extfile server.ext -out server.pem
ec other-ca.key
openssl req -x509 -new -key other-ca.key -sha256 -days $days -subj "/CN=kvferry other CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out other-ca.pem
rm -f server.csr server.ext ca.srl ca.key other-ca.key
