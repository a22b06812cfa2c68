//go:build tools

// Package tools records the commands this module builds: the control plane
// (kube-apiserver, kubectl) for every tier, and the node (kubelet,
// kube-controller-manager, kube-scheduler) for the node tier.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
