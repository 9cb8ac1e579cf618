# Certificates for the local cluster's own components (sourced by cluster/up.sh and
# scripts/keda.sh; the services' dev CA is scripts/services.sh's).

# A self-signed CA (<dir>/<ca>.crt and .key) and a certificate with common name <cn> that
# it signs (<dir>/<name>.crt and .key) with the openssl extensions <extensions>; nothing
# when that certificate exists. Ten years: they live as long as the local state.
local_ca_and_cert() { # dir, ca, name, cn, extensions
  local dir=$1 ca=$2 name=$3 cn=$4 extensions=$5
  [ -f "$dir/$name.crt" ] && return 0
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=$ca" \
    -keyout "$dir/$ca.key" -out "$dir/$ca.crt" 2>/dev/null
  openssl req -new -newkey rsa:2048 -nodes -subj "/CN=$cn" \
    -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
  printf '%s\n' "$extensions" >"$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/$ca.crt" -CAkey "$dir/$ca.key" \
    -CAcreateserial -days 3650 -extfile "$dir/$name.ext" -out "$dir/$name.crt" 2>/dev/null
}
