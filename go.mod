module github.com/tandem-llm/tandem

go 1.26.0

require (
	github.com/dlclark/regexp2 v1.12.0 // indirect
	github.com/ebitengine/purego v0.11.3 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.43.0 // indirect
)
