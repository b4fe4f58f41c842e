package nodeauth

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/linkauth"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// The metadata of an authenticated call. Binary values ride in "-bin"
// keys, which gRPC base64-encodes on the wire.
const (
	mdProtocol = "tandem-protocol"
	mdCaller   = "tandem-caller-bin"
	mdTime     = "tandem-call-time"
	mdNonce    = "tandem-call-nonce-bin"
	mdProof    = "tandem-call-proof-bin"
)

// purpose separates the proofs of Node calls from other uses of the
// credential (linkauth.Credential.Sign).
const purpose = "tandem.v1.Node call"

// DefaultMaxSkew is VerifierConfig.MaxSkew when it is 0: how far a call's
// time may be from the server's clock.
const DefaultMaxSkew = 5 * time.Minute

// servicePrefix is the prefix of the Node service's methods, the calls a
// Verifier checks.
var servicePrefix = "/" + tandemv1.Node_ServiceDesc.ServiceName + "/"

// Signer signs the Node calls of one node.
type Signer struct {
	// Node is the calling node's name; Protocol its internal protocol
	// versions (nodewire.Protocol).
	Node, Protocol string
	// Credential proves the call comes from the cluster (nil: the call
	// names its caller and protocol without proof).
	Credential *linkauth.Credential
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// Unary is a grpc.UnaryClientInterceptor that signs the Node service's
// calls and passes every other call unchanged.
func (s Signer) Unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if !strings.HasPrefix(method, servicePrefix) {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	md, err := s.metadata(method, req)
	if err != nil {
		return err
	}
	return invoker(metadata.AppendToOutgoingContext(ctx, md...), method, req, reply, cc, opts...)
}

// metadata is the key-value pairs that authenticate a call of method
// with req.
func (s Signer) metadata(method string, req any) ([]string, error) {
	now := time.Now
	if s.Now != nil {
		now = s.Now
	}
	md := []string{mdProtocol, s.Protocol, mdCaller, s.Node}
	if s.Credential == nil {
		return md, nil
	}
	body, err := bodyHash(req)
	if err != nil {
		return nil, fmt.Errorf("sign %s: %w", method, err)
	}
	t := strconv.FormatInt(now().UnixNano(), 10)
	nonce := linkauth.NewNonce()
	proof := s.Credential.Sign(purpose, []byte(s.Protocol), []byte(s.Node), []byte(method), []byte(t), nonce, body)
	return append(md, mdTime, t, mdNonce, string(nonce), mdProof, string(proof)), nil
}

// bodyHash is the SHA-256 of req's deterministic encoding: the same
// message has the same hash at both ends.
func bodyHash(req any) ([]byte, error) {
	m, ok := req.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("request %T is not a protobuf message", req)
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode the request: %w", err)
	}
	h := sha256.Sum256(b)
	return h[:], nil
}

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Protocol is this node's internal protocol versions: a caller naming
	// others is refused.
	Protocol string
	// Credential checks the calls' proofs (nil: calls are not
	// authenticated, only their protocol checked).
	Credential *linkauth.Credential
	// Authorize decides whether the caller, authenticated (or, without a
	// credential, as it named itself), may make the call; an error
	// refuses it as it is (give it an apierr kind). Nil allows every
	// caller.
	Authorize func(ctx context.Context, caller, method string) error
	// MaxSkew is how far a call's time may be from this node's clock
	// (default DefaultMaxSkew); a nonce is remembered as long.
	MaxSkew time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// Verifier checks the Node calls a node serves.
type Verifier struct {
	cfg  VerifierConfig
	mu   sync.Mutex
	seen map[string]time.Time // nonces of accepted calls, with their call times
}

// NewVerifier returns a Verifier; it starts nothing.
func NewVerifier(cfg VerifierConfig) *Verifier {
	if cfg.MaxSkew <= 0 {
		cfg.MaxSkew = DefaultMaxSkew
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Verifier{cfg: cfg, seen: map[string]time.Time{}}
}

// callerKey carries the checked caller in a call's context.
type callerKey struct{}

// Caller is the name of the node that made the call ctx belongs to, as
// the Verifier checked it.
func Caller(ctx context.Context) (string, bool) {
	c, ok := ctx.Value(callerKey{}).(string)
	return c, ok
}

// Unary is a grpc.UnaryServerInterceptor: it checks the Node service's
// calls and passes every other call unchanged.
func (v *Verifier) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !strings.HasPrefix(info.FullMethod, servicePrefix) {
		return handler(ctx, req)
	}
	caller, err := v.check(ctx, info.FullMethod, req)
	if err != nil {
		return nil, apierr.GRPC(err)
	}
	if v.cfg.Authorize != nil {
		if err := v.cfg.Authorize(ctx, caller, info.FullMethod); err != nil {
			return nil, apierr.GRPC(err)
		}
	}
	return handler(context.WithValue(ctx, callerKey{}, caller), req)
}

// check authenticates a call of method with req and returns its caller.
func (v *Verifier) check(ctx context.Context, method string, req any) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	get := func(k string) (string, bool) {
		vs := md.Get(k)
		if len(vs) != 1 {
			return "", false
		}
		return vs[0], true
	}
	protocol, _ := get(mdProtocol)
	caller, _ := get(mdCaller)
	who := "the caller"
	if caller != "" {
		who = fmt.Sprintf("node %q", caller)
	}
	switch {
	case protocol == "":
		return "", apierr.Unauthenticatedf("%s: %s names no internal protocol (a tandem node of this version sends %q)", method, who, v.cfg.Protocol)
	case protocol != v.cfg.Protocol:
		return "", apierr.Preconditionf("%s: %s speaks internal protocol %q, this node %q: run the same tandem version on every node", method, who, protocol, v.cfg.Protocol)
	case caller == "":
		return "", apierr.Unauthenticatedf("%s: the call names no calling node", method)
	}
	t, hasTime := get(mdTime)
	nonce, hasNonce := get(mdNonce)
	proof, hasProof := get(mdProof)
	if v.cfg.Credential == nil {
		if hasProof {
			return "", apierr.Unauthenticatedf("%s: %v", method, linkauth.ErrUnexpectedProof)
		}
		return caller, nil
	}
	if !hasProof || !hasTime || !hasNonce {
		return "", apierr.Unauthenticatedf("%s from %s: %v", method, who, linkauth.ErrNoProof)
	}
	if len(nonce) != linkauth.NonceSize {
		return "", apierr.Unauthenticatedf("%s from %s: %v", method, who, linkauth.ErrBadNonce)
	}
	ns, err := strconv.ParseInt(t, 10, 64)
	if err != nil {
		return "", apierr.Unauthenticatedf("%s from %s: call time %q is not a number", method, who, t)
	}
	body, err := bodyHash(req)
	if err != nil {
		return "", apierr.Invalidf("%s: %v", method, err)
	}
	if !v.cfg.Credential.Verify([]byte(proof), purpose, []byte(protocol), []byte(caller), []byte(method), []byte(t), []byte(nonce), body) {
		return "", apierr.Unauthenticatedf("%s from %s: %v", method, who, linkauth.ErrBadProof)
	}
	at, now := time.Unix(0, ns), v.cfg.Now()
	if skew := now.Sub(at); skew > v.cfg.MaxSkew || skew < -v.cfg.MaxSkew {
		return "", apierr.Unauthenticatedf("%s from %s: the call was made %v from this node's clock, more than %v: keep the nodes' clocks in step (NTP)", method, who, skew.Round(time.Millisecond), v.cfg.MaxSkew)
	}
	if !v.remember(nonce, at, now) {
		return "", apierr.Unauthenticatedf("%s from %s: a replay of a call already served", method, who)
	}
	return caller, nil
}

// remember records the nonce of a call made at at, and reports false when
// it was already seen. Nonces are forgotten once their calls are too old
// to pass the clock check.
func (v *Verifier) remember(nonce string, at, now time.Time) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for n, t := range v.seen {
		if now.Sub(t) > v.cfg.MaxSkew {
			delete(v.seen, n)
		}
	}
	if _, ok := v.seen[nonce]; ok {
		return false
	}
	v.seen[nonce] = at
	return true
}
