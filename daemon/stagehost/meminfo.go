package stagehost

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
)

// hostMemory is the host's total and available memory in bytes, from
// /proc/meminfo.
func hostMemory() (total, avail uint64, err error) {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, fmt.Errorf("host memory: %w", err)
	}
	return parseMeminfo(data)
}

// parseMeminfo reads MemTotal and MemAvailable (kB) from /proc/meminfo's
// text.
func parseMeminfo(data []byte) (total, avail uint64, err error) {
	found := map[string]*uint64{"MemTotal": &total, "MemAvailable": &avail}
	seen := 0
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), ":")
		dst := found[key]
		if !ok || dst == nil {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, 0, fmt.Errorf("host memory: /proc/meminfo %s: %q, want a number of kB", key, rest)
		}
		v, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil || v > 1<<53 {
			return 0, 0, fmt.Errorf("host memory: /proc/meminfo %s: %q, want a number of kB", key, rest)
		}
		*dst = v << 10
		seen++
	}
	if seen != len(found) {
		return 0, 0, fmt.Errorf("host memory: /proc/meminfo lacks MemTotal or MemAvailable")
	}
	if avail > total {
		avail = total
	}
	return total, avail, nil
}

// cpuName names the host's processor for the member metadata.
func cpuName() string {
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.Lines(string(data)) {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				return fmt.Sprintf("%s (%d threads)", strings.TrimSpace(v), runtime.NumCPU())
			}
		}
	}
	return fmt.Sprintf("%s CPU (%d threads)", runtime.GOARCH, runtime.NumCPU())
}
