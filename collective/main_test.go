package collective

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestMain runs the subprocess peer when asked to (see killedPeerMain) and
// otherwise the tests, then fails the run if any goroutine of this package
// outlived them.
func TestMain(m *testing.M) {
	if addr := os.Getenv(killedPeerEnv); addr != "" {
		os.Exit(killedPeerMain(addr))
	}
	code := m.Run()
	if code == 0 {
		if leaked := waitLeaks(5 * time.Second); leaked != nil {
			fmt.Fprintf(os.Stderr, "goroutines leaked by the tests:\n\n%s\n", strings.Join(leaked, "\n\n"))
			code = 1
		}
	}
	os.Exit(code)
}

// waitLeaks waits up to timeout for the goroutines running code of this
// package, other than the caller, to end and returns the stacks of those
// that did not.
func waitLeaks(timeout time.Duration) []string {
	end := time.Now().Add(timeout)
	for {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		var leaked []string
		for i, g := range strings.Split(string(buf), "\n\n") {
			if i > 0 && strings.Contains(g, "tandem-llm/tandem/collective.") {
				leaked = append(leaked, g)
			}
		}
		if leaked == nil || time.Now().After(end) {
			return leaked
		}
		time.Sleep(10 * time.Millisecond)
	}
}
