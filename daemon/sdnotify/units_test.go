package sdnotify

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// unitsDir is the repository's systemd/ directory.
const unitsDir = "../../systemd"

// verifyRoot builds a root directory for systemd-analyze --root: the host's
// system units (targets the units depend on), the units under test in
// /etc/systemd/system, and an executable standing in for tandemd.
func verifyRoot(t *testing.T, units map[string][]byte) string {
	t.Helper()
	root := t.TempDir()
	sys := ""
	for _, d := range []string{"/usr/lib/systemd/system", "/lib/systemd/system"} {
		if _, err := os.Stat(filepath.Join(d, "sysinit.target")); err == nil {
			sys = d
			break
		}
	}
	if sys == "" {
		t.Skip("systemd's unit directory not found: install Debian's systemd package to verify the units")
	}
	for _, d := range []string{"usr/lib/systemd", "etc/systemd/system", "usr/local/bin"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("cp", "-a", sys, filepath.Join(root, "usr/lib/systemd/system")).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", sys, err, out)
	}
	if err := os.WriteFile(filepath.Join(root, "usr/local/bin/tandemd"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, b := range units {
		if err := os.WriteFile(filepath.Join(root, "etc/systemd/system", name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// analyzeVerify runs systemd-analyze verify on units in root and returns
// its output; systemd-analyze reports some problems (unknown keys, values
// it cannot parse) only as warnings, so any output is a failure.
func analyzeVerify(t *testing.T, root string, units ...string) (string, error) {
	t.Helper()
	args := append([]string{"verify", "--man=false", "--root=" + root}, units...)
	out, err := exec.Command("systemd-analyze", args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func readUnits(t *testing.T) map[string][]byte {
	t.Helper()
	units := map[string][]byte{}
	for _, name := range []string{"tandemd.service", "tandemd@.service"} {
		b, err := os.ReadFile(filepath.Join(unitsDir, name))
		if err != nil {
			t.Fatal(err)
		}
		units[name] = b
	}
	return units
}

// TestUnitsVerify runs systemd-analyze verify on the units (the template
// as instance 0), and checks that it does catch a broken unit.
func TestUnitsVerify(t *testing.T) {
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Skip("systemd-analyze not installed (Debian package systemd): units not verified")
	}
	units := readUnits(t)
	root := verifyRoot(t, units)
	out, err := analyzeVerify(t, root, "tandemd.service", "tandemd@0.service")
	if err != nil || out != "" {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}

	broken := map[string][]byte{"tandemd.service": []byte(strings.Replace(string(units["tandemd.service"]),
		"WatchdogSec=30", "WatchdogSec=soon", 1))}
	out, _ = analyzeVerify(t, verifyRoot(t, broken), "tandemd.service")
	if !strings.Contains(out, "soon") {
		t.Fatalf("systemd-analyze verify accepted WatchdogSec=soon: %q", out)
	}
}

// TestUnitsContract checks the settings the daemon relies on, which
// systemd-analyze cannot know about.
func TestUnitsContract(t *testing.T) {
	units := readUnits(t)
	common := []string{
		"Type=notify", "NotifyAccess=main", "WatchdogSec=30", "Restart=on-failure",
		"User=tandem", "Group=tandem", "StateDirectory=tandem", "CacheDirectory=tandem",
		"Environment=TANDEM_CACHE_DIR=%C/tandem", "KillSignal=SIGTERM",
		"NoNewPrivileges=yes", "ProtectSystem=strict", "DevicePolicy=closed", "DeviceAllow=char-nvidia* rw",
		"CapabilityBoundingSet=", "AmbientCapabilities=",
	}
	perUnit := map[string][]string{
		"tandemd.service": {"ExecStart=/usr/local/bin/tandemd serve --config /etc/tandem/tandemd.toml", "RuntimeDirectory=tandem"},
		"tandemd@.service": {"ExecStart=/usr/local/bin/tandemd serve --config /etc/tandem/tandemd-%i.toml",
			"Environment=CUDA_VISIBLE_DEVICES=%i", "RuntimeDirectory=tandem/%i"},
	}
	// Settings that would break GPU access or the CUDA driver.
	forbidden := []string{"PrivateDevices=", "MemoryDenyWriteExecute=", "DynamicUser=", "ProcSubset="}
	for name, b := range units {
		lines := map[string]bool{}
		for _, l := range strings.Split(string(b), "\n") {
			lines[strings.TrimSpace(l)] = true
			for _, f := range forbidden {
				if strings.HasPrefix(l, f) {
					t.Errorf("%s sets %s", name, l)
				}
			}
		}
		for _, want := range append(append([]string{}, common...), perUnit[name]...) {
			if !lines[want] {
				t.Errorf("%s lacks %q", name, want)
			}
		}
	}
}

// TestSysusers creates the account from systemd/tandem.sysusers in an
// empty root.
func TestSysusers(t *testing.T) {
	if _, err := exec.LookPath("systemd-sysusers"); err != nil {
		t.Skip("systemd-sysusers not installed (Debian package systemd): sysusers file not checked")
	}
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	file, err := filepath.Abs(filepath.Join(unitsDir, "tandem.sysusers"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("systemd-sysusers", "--root="+root, file).CombinedOutput(); err != nil {
		t.Fatalf("systemd-sysusers: %v\n%s", err, out)
	}
	passwd, err := os.ReadFile(filepath.Join(root, "etc/passwd"))
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, l := range strings.Split(string(passwd), "\n") {
		f := strings.Split(l, ":")
		if len(f) == 7 && f[0] == "tandem" {
			found = true
			if f[5] != "/var/lib/tandem" || !strings.HasSuffix(f[6], "nologin") {
				t.Errorf("tandem account %q: want home /var/lib/tandem and no login shell", l)
			}
		}
	}
	if !found {
		t.Fatalf("no tandem account in:\n%s", passwd)
	}
}
