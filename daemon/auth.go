package daemon

import (
	"context"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/tandem-llm/tandem/daemon/apierr"
)

// guarded are the services whose calls must carry the admin token.
var guarded = []string{"/tandem.v1.Admin/", "/tandem.v1.Node/"}

// tokenAuth checks the admin token on the guarded services.
type tokenAuth struct{ token string }

func (a tokenAuth) check(ctx context.Context, method string) error {
	if a.token == "" {
		return nil
	}
	isGuarded := false
	for _, prefix := range guarded {
		isGuarded = isGuarded || strings.HasPrefix(method, prefix)
	}
	if !isGuarded {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		got, ok := bearerToken(v)
		if ok && subtle.ConstantTimeCompare([]byte(got), []byte(a.token)) == 1 {
			return nil
		}
	}
	return apierr.GRPC(apierr.Unauthenticatedf("%s needs the admin token (authorization: Bearer TOKEN)", method))
}

// bearerToken reads the token of an authorization value of the Bearer
// scheme, whose name is case-insensitive (RFC 6750, RFC 9110 section
// 11.1), followed by one space or more.
func bearerToken(v string) (string, bool) {
	scheme, rest, ok := strings.Cut(v, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token := strings.TrimLeft(rest, " ")
	return token, token != ""
}

func (a tokenAuth) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := a.check(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (a tokenAuth) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := a.check(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}

// bearer sends the admin token with every call of a client.
type bearer struct {
	token  string
	secure bool
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials: the
// token travels in clear only where the daemon itself runs without TLS.
func (b bearer) RequireTransportSecurity() bool { return b.secure }

// serverCreds are the gRPC listener's credentials: TLS when a certificate
// is configured.
func serverCreds(sec SecurityConfig) (credentials.TransportCredentials, error) {
	if sec.TLSCertFile == "" {
		return insecure.NewCredentials(), nil
	}
	cert, err := tls.LoadX509KeyPair(sec.TLSCertFile, sec.TLSKeyFile)
	if err != nil {
		return nil, fmt.Errorf("security: load TLS certificate %s and key %s: %w", sec.TLSCertFile, sec.TLSKeyFile, err)
	}
	return credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}), nil
}

// clientCreds are what this daemon uses to call other daemons: TLS
// (verified against the configured CA, or the system's roots) when it
// serves TLS itself, and the admin token when it has one.
func clientCreds(sec SecurityConfig, token string) ([]grpc.DialOption, error) {
	tlsOn := sec.TLSCertFile != ""
	creds := insecure.NewCredentials()
	if tlsOn {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if sec.TLSCAFile != "" {
			pool, err := loadCAs(sec.TLSCAFile)
			if err != nil {
				return nil, fmt.Errorf("security.tls_ca_file: %w", err)
			}
			cfg.RootCAs = pool
		}
		creds = credentials.NewTLS(cfg)
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{token: token, secure: tlsOn}))
	}
	return opts, nil
}

// loadCAs reads PEM certificates into a pool.
func loadCAs(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificate", path)
	}
	return pool, nil
}
