package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// Environment variables the client flags default from.
const (
	addrEnv  = "TANDEM_ADDR"
	tokenEnv = "TANDEM_TOKEN"
)

const defaultAddr = "127.0.0.1:7400"

// clientFlags say how to reach the leader.
type clientFlags struct {
	addr    string
	token   string
	tls     bool
	tlsCA   string
	timeout time.Duration
}

func (c *clientFlags) register(f *pflag.FlagSet) {
	f.StringVar(&c.addr, "addr", "", "the leader's gRPC address (default: $"+addrEnv+", else "+defaultAddr+")")
	f.StringVar(&c.token, "token", "", "admin token (default: $"+tokenEnv+")")
	f.BoolVar(&c.tls, "tls", false, "use TLS, verifying the server against the system's roots")
	f.StringVar(&c.tlsCA, "tls-ca", "", "use TLS, verifying the server against this CA certificate file")
	f.DurationVar(&c.timeout, "timeout", 0, "give up after this long (0: never)")
}

// dial connects to the leader at --addr, else $TANDEM_ADDR, else the
// default address. The admin token is sent with every call when given
// (flag or environment).
func (c *clientFlags) dial() (*grpc.ClientConn, error) {
	if c.addr == "" {
		c.addr = cmp.Or(os.Getenv(addrEnv), defaultAddr)
	}
	creds := insecure.NewCredentials()
	secure := c.tls || c.tlsCA != ""
	if secure {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if c.tlsCA != "" {
			pem, err := os.ReadFile(c.tlsCA)
			if err != nil {
				return nil, fmt.Errorf("--tls-ca: %w", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--tls-ca %s: no PEM certificate", c.tlsCA)
			}
		}
		creds = credentials.NewTLS(cfg)
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	token := c.token
	if token == "" {
		token = os.Getenv(tokenEnv)
	}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{token: token, secure: secure}))
	}
	conn, err := grpc.NewClient(c.addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", c.addr, err)
	}
	return conn, nil
}

// open dials the daemon and bounds parent by --timeout; done closes both.
func (c *clientFlags) open(parent context.Context) (conn *grpc.ClientConn, ctx context.Context, done func(), err error) {
	if conn, err = c.dial(); err != nil {
		return nil, nil, nil, err
	}
	var cancel context.CancelFunc
	if c.timeout > 0 {
		ctx, cancel = context.WithTimeout(parent, c.timeout)
	} else {
		ctx, cancel = context.WithCancel(parent)
	}
	return conn, ctx, func() { cancel(); conn.Close() }, nil
}

// bearer sends the admin token as "authorization: Bearer TOKEN".
type bearer struct {
	token  string
	secure bool
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (b bearer) RequireTransportSecurity() bool { return b.secure }

// adminShow runs one Admin call against the daemon the flags name and
// prints its answer: as JSON with asJSON, else with print.
func adminShow[R proto.Message](cmd *cobra.Command, c *clientFlags, asJSON bool, what string,
	call func(context.Context, tandemv1.AdminClient) (R, error), print func(io.Writer, R) error) error {
	conn, ctx, done, err := c.open(cmd.Context())
	if err != nil {
		return err
	}
	defer done()
	r, err := call(ctx, tandemv1.NewAdminClient(conn))
	if err != nil {
		return fmt.Errorf("%s of %s: %w", what, c.addr, err)
	}
	if !asJSON {
		return print(cmd.OutOrStdout(), r)
	}
	b, err := protojson.MarshalOptions{Multiline: true, EmitUnpopulated: true}.Marshal(r)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(cmd.OutOrStdout(), string(b))
	return err
}
